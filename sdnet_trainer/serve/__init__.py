"""``python -m sdnet_trainer.serve``: a checkpoint or an export folder behind a REST API.

The modules: ``args`` (the command's arguments), ``model`` (rebuilding the model as export does,
and running it with PyTorch or onnxruntime), ``images`` and ``language`` (what a request becomes
and what comes back), ``decoding`` (generation with a KV cache, in batches that rows join and
leave), ``engine`` (continuous batching), ``batching`` (dynamic batching), ``openai_api`` (the
OpenAI API's routes), ``app`` (the FastAPI application, its metrics and limits) and ``__main__``
(the command). Importing this package imports none of the
``serve`` extra's packages.
"""
