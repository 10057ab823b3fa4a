"""mmspec.demos: the Gradio demo (``mmspec demo``), one tab per pipeline family.

* :mod:`.common`: loading pipelines by path (cached), input checks, speculative-vs-baseline runs,
  statistics panels, acceptance maps (shared by every tab; no gradio).
* :mod:`.vlm_tab`, :mod:`.ar_image_tab`, :mod:`.continuous_tab`, :mod:`.video_tab`: each tab's logic as
  plain functions (``run_vlm``, ``run_ar_image``, ``run_continuous``, ``run_video``), tested without a browser.
* :mod:`.app`: the Gradio page (``build_app``, ``launch``); the only module that imports gradio.
* :mod:`.launch`: the ``mmspec demo`` command; :mod:`.tiny`: tiny random pipelines for tests and
  ``mmspec demo --tiny``; :mod:`.browser`: the headless Chromium used by the browser test and
  :mod:`.screenshot`.

gradio is an optional extra (``pip install "mmspec[demo]"``): importing this package does not import it.
"""
