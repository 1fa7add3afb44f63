"""A checkpoint's generation defaults: every EOS id it declares and the sampling it recommends.

config.json and generation_config.json may both list EOS ids (Llama-3.1-Instruct lists three); any of
them ends a request, as in transformers' generate() and vLLM. generation_config.json's temperature,
top_p, top_k and max_new_tokens become the default sampling parameters (vLLM's --generation-config auto);
do_sample false there means greedy, as transformers reads it.
"""
from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.engine.request import SamplingParams

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# Sampling settings a generation_config.json may recommend that SamplingParams has no field for.
_UNSUPPORTED_SAMPLING = ("repetition_penalty", "min_p", "typical_p", "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class GenerationDefaults:
    eos_token_ids: tuple[int, ...] = ()  # the first is the primary EOS; any of them ends a request
    sampling: dict[str, Any] = dataclasses.field(default_factory=dict)  # SamplingParams field -> default

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    def sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams with the checkpoint's defaults, then the given fields on top."""
        return SamplingParams(**{**self.sampling, **overrides})


def eos_ids(value: Any) -> tuple[int, ...]:
    """An eos_token_id field (None, one id or a list of ids) as a tuple."""
    if value is None:
        return ()
    ids = (value,) if isinstance(value, int) else tuple(value)
    for token_id in ids:
        if not isinstance(token_id, int) or isinstance(token_id, bool) or token_id < 0:
            raise ValueError(f"eos_token_id entries must be non-negative integers, got {value!r}")
    return ids


def generation_defaults(config_eos_token_ids: tuple[int, ...], model_dir: Path | None) -> GenerationDefaults:
    """The EOS ids of config.json merged with generation_config.json's (config.json's first, no repeats),
    and the sampling defaults the latter sets."""
    generation: dict[str, Any] = {}
    if model_dir is not None and (model_dir / GENERATION_CONFIG_FILE).is_file():
        with (model_dir / GENERATION_CONFIG_FILE).open() as f:
            generation = json.load(f)
    ids = tuple(dict.fromkeys(config_eos_token_ids + eos_ids(generation.get("eos_token_id"))))
    return GenerationDefaults(eos_token_ids=ids, sampling=_sampling_defaults(generation))


def _sampling_defaults(generation: dict[str, Any]) -> dict[str, Any]:
    defaults: dict[str, Any] = {}
    if generation.get("max_new_tokens") is not None:
        defaults["max_tokens"] = int(generation["max_new_tokens"])
    ignored = [name for name in _UNSUPPORTED_SAMPLING if generation.get(name) not in (None, 1.0, 0.0)]
    if ignored:
        logger.warning("%s recommends %s, which this engine does not implement; requests sample without them",
                       GENERATION_CONFIG_FILE, ", ".join(f"{n}={generation[n]}" for n in ignored))
    if generation.get("do_sample") is False:
        return defaults  # greedy, whatever temperature the file also names
    for name in ("temperature", "top_p", "top_k"):
        if generation.get(name) is not None:
            defaults[name] = generation[name]
    if defaults.get("top_k") is not None:
        defaults["top_k"] = int(defaults["top_k"])
    SamplingParams(**defaults)  # a value out of range fails at load, not on the first request
    return defaults
