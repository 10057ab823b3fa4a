"""The systems benchmark (``python -m mmspec.evaluation.bench_systems``): how close each pipeline's speculative
loop comes to its theoretical bound at the sizes users run.

Random weights at the real architectures' sizes, a controlled acceptance rate, the product's own loops:

* :mod:`.specs`: one table of architectures (public config values, cited) and the methods each one runs;
* :mod:`.builders`: those architectures and their drafters built from the repo's model classes, assembled
  into the repo's pipelines;
* :mod:`.controlled`: the drafter wrapper that makes the acceptance rate known in advance;
* :mod:`.timing`: forward timers around the target and the drafter;
* :mod:`.token_rows` / :mod:`.block_rows`: running one row (a method, an acceptance rate, a batch) through a
  pipeline's real loop and turning the timings into the reported quantities;
* :mod:`.report`: the markdown table, the JSON payload and the plot.
"""
