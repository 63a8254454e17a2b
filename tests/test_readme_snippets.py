"""Every Python block of README.md, docs/usage.md and docs/optimizers.md runs as written, in order, one namespace per
document, on the CPU.

The blocks are fragments of a user's program: a short prelude per block supplies what the text leaves to the
reader (a model, a batch, a direction), at toy sizes. A block edited without its prelude still running here fails
this test; a block added without a prelude fails it too (PRELUDES has one entry per block of each document).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL)

# The tiny GPT of the LM recipe, a batch of its tokens and a direction in parameter space.
GPT_BATCH = """
from recipes.lm.model import GPT
torch.manual_seed(0)
model = GPT(vocab_size=32, d_model=16, n_layers=1, n_heads=2, mlp="gelu")
x, y = torch.randint(0, 32, (2, 12)), torch.randint(0, 32, (2, 12))
params = list(model.parameters())
vec = [torch.randn_like(p) for p in params]
"""

LOADER = "loader = [(torch.randint(0, 256, (2, 12)), torch.randint(0, 256, (2, 12)))] * 2"
SMALL_QKV = """
import flashbob
q, k, v = (torch.randn(1, 2, 64, 8) for _ in range(3))
ids = torch.arange(4).repeat_interleave(16)[None]
padding = torch.rand(1, 64) > 0.3
padding[:, 0] = True
from torch.nn.attention.flex_attention import create_block_mask
block_mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 64, 64, device="cpu")
"""

PRELUDES = {
    "README.md": [
        LOADER,  # the first example is whole but for the data
        SMALL_QKV,
    ],
    "docs/usage.md": [
        "",  # the first example is whole
        "import flashbob; q = torch.randn(1, 4, 1024, 16); k, v = torch.randn(1, 2, 1024, 16), torch.randn(1, 2, 1024, 16)",
        "q, k, v = (torch.randn(2, 4, 9, 8) for _ in range(3)); padding = torch.rand(2, 9) > 0.3; padding[:, 0] = True",
        GPT_BATCH,
        """
from transformers import AutoModelForCausalLM, LlamaConfig
config = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=32)
""",
        "q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64) for _ in range(3))",
        GPT_BATCH + """
from torch import nn
class LastPosition(nn.Module):  # curvlinops' CrossEntropyLoss wants (batch, classes) logits
    def __init__(self, gpt):
        super().__init__()
        self.gpt = gpt
    def forward(self, tokens):
        return self.gpt(tokens)[:, -1]
model = LastPosition(model)
y = y[:, -1]
v = torch.randn(sum(p.numel() for p in params))
""",
    ],
    "docs/optimizers.md": [
        GPT_BATCH + """
import torch.nn.functional as F
logits = model(x)
targets = y
loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
""",
        GPT_BATCH,
        "loader = [(x, y)] * 3",
    ],
}


@pytest.mark.parametrize("document", list(PRELUDES))
def test_every_python_block_runs(document):
    blocks = PYTHON_BLOCK.findall((ROOT / document).read_text())
    preludes = PRELUDES[document]
    assert len(blocks) == len(preludes), (
        f"{document} has {len(blocks)} Python blocks and this test {len(preludes)} preludes: give the new block one"
    )
    if document == "docs/usage.md":
        pytest.importorskip("transformers")
        pytest.importorskip("curvlinops")
    namespace: dict = {"torch": torch}
    for index, (prelude, block) in enumerate(zip(preludes, blocks)):
        try:
            exec(prelude, namespace)
            exec(block, namespace)
        except Exception as error:
            raise AssertionError(f"{document}'s Python block {index} failed:\n{block}") from error
    if document == "docs/usage.md":
        assert namespace["H"] is not None and namespace["gv"] is not None
