"""mmspec.evaluation: metrics and benchmark tools.

* :mod:`.fid` - Frechet distance with a pluggable feature extractor (InceptionV3 from a local file, or the
  shapes-world feature network of :mod:`.shapes_features`).
* :mod:`.clip_score` - CLIP score with open_clip.
* :mod:`.imagereward` - ImageReward through the image-reward package (local weights).
* :mod:`.geneval` - the GenEval protocol for COCO objects and for the shapes world.
* :mod:`.speed` - the speed harness every pipeline benchmark uses.
* :mod:`.distributed` - sharding of generation across processes (accelerate / torchrun / single).

Submodules are imported on demand (``from mmspec.evaluation import fid``), so importing this package stays
cheap and the optional dependencies (open_clip, image-reward, torch-fidelity, matplotlib) are only
needed by the tools that use them. Each tool has a command line: ``python -m mmspec.evaluation.<tool> --help``.
"""

from .speed import BenchmarkReport, CaseReport, RunResult, run_benchmark

__all__ = ["BenchmarkReport", "CaseReport", "RunResult", "run_benchmark"]
