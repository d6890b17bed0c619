"""Tiny models whose K/V reach thousands, as Qwen2-family checkpoints' do, and a text to evaluate them on."""

from __future__ import annotations

import os
import random

from safetensors.torch import load_file, save_file

# Output rows of k_proj / v_proj scaled up: those channels of K and V then reach thousands.
OUTLIER_ROWS = (("k_proj", [3, 35, 70]), ("v_proj", [5, 100]))


def add_kv_outliers(model_path: str, layers: list[int], factor: float = 3000.0) -> None:
    """Scales the outlier rows of `layers`' K and V projections in the model folder's weights, in place."""
    weights_file = os.path.join(model_path, "model.safetensors")
    weights = load_file(weights_file)
    for layer in layers:
        for name, rows in OUTLIER_ROWS:
            weights[f"model.layers.{layer}.self_attn.{name}.weight"][rows] *= factor
    save_file(weights, weights_file, metadata={"format": "pt"})


def random_words_file(folder, num_words: int) -> str:
    """A text of `num_words` tiny-vocabulary words (seeded), written in `folder`; its path."""
    from conftest import TINY_WORDS

    rng = random.Random(0)
    path = folder / "words.txt"
    path.write_text(" ".join(rng.choice(TINY_WORDS) for _ in range(num_words)))
    return str(path)
