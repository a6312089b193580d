"""Model quality against text and against a reference model: perplexity as
``llama-perplexity`` computes it (``perplexity``), KL-divergence statistics over
log-probabilities (``kld``), the reference log-prob files (``logits_file``), the public-domain
test text (``corpus``), the tables (``report``) and the ``deimos perplexity`` command (``cli``)."""
