"""llama.cpp's converter for tokenizers it has no hash for: the tests' tiny ones, and the
engine benchmark's random-weight Qwen2.5-0.5B shape, which carries SmolLM2's vocabulary (and
which transformers 5 loads through Qwen2's own pre-tokenizer, for its config's model type).

llama.cpp identifies a BPE tokenizer's pre-tokenizer by the hash of a test string's token ids
and refuses one it has no hash for. Run as a script (`python gguf_converter_shim.py
convert_hf_to_gguf.py ARGS...`) this file runs the converter with such a tokenizer written
as GPT-2's pre-tokenizer (byte-level), everything else as it is;
`unknown_tokenizer_converter()` makes `recurformer.export` run the converter that way. The
real models' tokenizers need neither.
"""

from __future__ import annotations

import runpy
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def unknown_tokenizer_converter() -> Iterator[None]:
    """Within the block, `recurformer.export` runs the engine's converter through this script."""
    from recurformer import export

    wrapped = export.converter_command
    export.converter_command = lambda *args: [sys.executable, __file__, *wrapped(*args)[1:]]
    try:
        yield
    finally:
        export.converter_command = wrapped


def main() -> None:
    script = Path(sys.argv[1])
    sys.path.insert(0, str(script.parent))
    from conversion.base import TextModel

    recognized = TextModel.get_vocab_base_pre

    def pre_tokenizer(self, tokenizer) -> str:
        try:
            return recognized(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"

    TextModel.get_vocab_base_pre = pre_tokenizer
    sys.argv = sys.argv[1:]
    runpy.run_path(str(script), run_name="__main__")


if __name__ == "__main__":
    main()
