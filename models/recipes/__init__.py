"""Training recipes of the reference zoo (one command each, deterministic, CPU minutes) and the training
losses they use (``eagle_loss``, ``mar_loss``, ``video_loss``, ``vlm_drafter_loss``, ``vlm_answer_loss``,
``autoencoder_training``), one module each, so that the model files hold no training code."""
