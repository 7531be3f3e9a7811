"""Handing artifacts to existing serving engines, never a server of our own.

triton.py         a Triton model repository from an artifact (`pipeline export triton`), checked against Triton's schema
triton_server.py  a local tritonserver (from nvidia-pytriton) for the Python-backend models, for tests and the bench
triton_models/    the Python-backend models the repository carries (tokenizer step, whole runtime)
ray_serve.py      the artifact as a Ray Serve application (`pipeline serve`)
openai_api.py     OpenAI's HTTP API on that application: request checks and answers (no Ray)
openai_routes.py  those requests run on the loaded artifact
"""
