"""POST /v1/embeddings on a live Ray Serve deployment of the tiny BERT, called through the `openai` client. Its own
module: Ray Serve runs one application at a time, and tests/serving/test_openai_api.py holds the decoder's."""

import numpy as np
import pytest

from pipeline.runtime import load
from tests.conftest import SMALL_TEXTS

openai = pytest.importorskip("openai", reason="the openai client is in the `dev` extra")
pytest.importorskip("ray.serve", reason="Ray Serve is the `serve` extra")


@pytest.mark.slow  # a live Ray Serve deployment
def test_embeddings_equal_the_runtime_as_floats_and_base64_and_chat_is_refused_naming_the_routes(published_fp32):
    from pipeline.serving import ray_serve
    from pipeline.serving.triton_server import free_port

    expected = load(published_fp32).run(SMALL_TEXTS[:5])
    model_id = f"{published_fp32.parent.parent.name}/{published_fp32.parent.name}"
    url = ray_serve.deploy(published_fp32, port=free_port())
    try:
        client = openai.OpenAI(base_url=url + "v1", api_key="none", max_retries=0, timeout=120)
        assert [m.id for m in client.models.list().data] == [model_id]
        floats = client.embeddings.create(model=model_id, input=SMALL_TEXTS[:5], encoding_format="float")
        packed = client.embeddings.create(model=model_id, input=SMALL_TEXTS[:5])  # the client asks for base64
        one = client.embeddings.create(model=model_id, input=SMALL_TEXTS[0])
        with pytest.raises(openai.NotFoundError, match=r"serves GET /v1/models, POST /v1/embeddings and POST /"):
            client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": "hi"}])
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=model_id, input="a", dimensions=8)
    finally:
        ray_serve.shutdown()
    assert err.value.body["param"] == "dimensions"
    for answer in (floats, packed):
        assert [d.index for d in answer.data] == list(range(5)) and answer.model == model_id
        np.testing.assert_allclose(np.array([d.embedding for d in answer.data]), expected, atol=1e-5, rtol=0)
        assert answer.usage.prompt_tokens == answer.usage.total_tokens > 5
    np.testing.assert_allclose(one.data[0].embedding, expected[0], atol=1e-5, rtol=0)
