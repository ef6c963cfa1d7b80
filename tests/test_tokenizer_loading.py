"""A replica's tokenizer, loaded by the class the engine's ``AutoTokenizer`` chose, is that
tokenizer: same class, same ids, text, special tokens and chat template; and loading it that way
imports no torch (``workers/outputs/tokenizer_loading.py``)."""

import json
import shutil
import subprocess
import sys

import pytest

from pagedserve.devtools.model_matrix import MATRIX, ensure_matrix_model
from pagedserve.workers.outputs.tokenizer_loading import (load_tokenizer, load_tokenizer_of_class,
                                                          tokenizer_class_path)

TEXT = "Hello wörld, 12 345 <|im_end|>\n\t  spaces  and ünïcode 漢字 🙂"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
# A checkpoint's tokenizer_config.json may declare other classes than the family's; each takes
# another branch of AutoTokenizer's resolution (a byte-level tokenizer.json under LlamaTokenizer
# loads as TokenizersBackend).
DECLARED = ("LlamaTokenizer", "Qwen2TokenizerFast", "GPT2Tokenizer", "CohereTokenizer", "PreTrainedTokenizerFast")


def _declaring(tmp_path, declared: str) -> str:
    source = ensure_matrix_model("llama")
    folder = tmp_path / declared
    folder.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            shutil.copy(file, folder / file.name)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**config, "tokenizer_class": declared}))
    return str(folder)


def _assert_same_tokenizer(direct, auto) -> None:
    assert type(direct) is type(auto)
    assert len(direct) == len(auto) and direct.all_special_ids == auto.all_special_ids
    ids = auto.encode(TEXT)
    assert direct.encode(TEXT) == ids
    assert direct.encode(TEXT, add_special_tokens=False) == auto.encode(TEXT, add_special_tokens=False)
    assert direct.decode(ids) == auto.decode(ids)
    assert direct.decode(ids, skip_special_tokens=True) == auto.decode(ids, skip_special_tokens=True)
    assert direct.convert_ids_to_tokens(ids) == auto.convert_ids_to_tokens(ids)
    assert direct.eos_token_id == auto.eos_token_id and direct.bos_token_id == auto.bos_token_id
    assert (direct.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True))


@pytest.mark.parametrize("family", sorted(MATRIX))
def test_the_class_the_engine_chose_loads_the_same_tokenizer(family):
    path = str(ensure_matrix_model(family))
    auto = load_tokenizer(path)
    _assert_same_tokenizer(load_tokenizer_of_class(path, tokenizer_class_path(auto)), auto)


@pytest.mark.parametrize("declared", DECLARED)
def test_a_declared_class_loads_as_autotokenizer_resolves_it(declared, tmp_path):
    path = _declaring(tmp_path, declared)
    auto = load_tokenizer(path)
    _assert_same_tokenizer(load_tokenizer_of_class(path, tokenizer_class_path(auto)), auto)


@pytest.mark.parametrize("class_path", [None, "", "transformers_modules.acme.tok:AcmeTokenizer",
                                        "transformers.no_such_module:Tokenizer",
                                        "transformers.tokenization_utils_tokenizers:NoSuchClass"])
def test_no_class_its_own_code_or_an_unknown_class_resolve_by_autotokenizer(class_path):
    path = str(ensure_matrix_model("qwen2"))
    auto = load_tokenizer(path)
    assert type(auto).__name__ == "Qwen2Tokenizer"
    _assert_same_tokenizer(load_tokenizer_of_class(path, class_path), auto)


def test_a_replica_loads_its_tokenizer_without_torch():
    """What an ingress replica imports (its deployment, the handle) and its tokenizer by class
    leave torch unimported; AutoTokenizer would import it."""
    path = str(ensure_matrix_model("qwen2"))
    class_path = tokenizer_class_path(load_tokenizer(path))
    script = (
        "import sys\n"
        "import pagedserve.cluster.serving.deployment, pagedserve.cluster.handle\n"
        "from pagedserve.workers.outputs.tokenizer_loading import load_tokenizer_of_class\n"
        f"tokenizer = load_tokenizer_of_class({path!r}, {class_path!r})\n"
        "tokenizer.apply_chat_template([{'role': 'user', 'content': 'hi'}], tokenize=True)\n"
        "print(type(tokenizer).__name__, 'torch' in sys.modules)\n"
        "from transformers import AutoTokenizer\n"
        f"AutoTokenizer.from_pretrained({path!r})\n"
        "print('torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["Qwen2Tokenizer", "False", "True"], done.stdout + done.stderr
