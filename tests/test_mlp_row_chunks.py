"""A CPU step past two MLP row chunks runs the decoder's MLP a chunk at a time: the same bits as the
MLP over every row at once, packed (oneDNN) or not, in both dtypes, with a partial last chunk."""
from __future__ import annotations

import pytest
import torch

from shared.engine.model import llama
from shared.engine.model.loader import random_model
from shared.engine.model.model_config import ModelArchConfig

pytestmark = pytest.mark.slow

CONFIG = ModelArchConfig(vocab_size=300, hidden_size=64, intermediate_size=192, num_layers=1, num_heads=4,
                         num_kv_heads=2, max_position_embeddings=256, eos_token_id=None, bos_token_id=None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("packed", [True, False])
def test_chunked_mlp_equals_the_whole(monkeypatch, dtype, packed):
    model = random_model(CONFIG.with_dtype(dtype), seed=3)
    if packed:
        model.pack_weights()
    layer = model.layers[0]
    monkeypatch.setattr(llama, "MLP_ROW_CHUNK", 40)
    normed = torch.randn(2 * 40 * 3 + 17, CONFIG.hidden_size, generator=torch.Generator().manual_seed(1))
    normed = normed.to(CONFIG.with_dtype(dtype).torch_dtype)
    whole = layer._mlp_rows(normed)
    chunk_rows = []
    run_rows = layer._mlp_rows

    def counted(rows):
        chunk_rows.append(len(rows))
        return run_rows(rows)

    monkeypatch.setattr(layer, "_mlp_rows", counted)
    assert torch.equal(layer.mlp(normed), whole)
    assert chunk_rows == [40] * 6 + [17]  # it ran in chunks
    layer.mlp(normed[:80])
    assert chunk_rows[-1] == 80  # two chunks' rows or fewer: one call
