"""checkpoints/rundir.py: where a run's generation ends (Run.eos, Run.stop_ids), read from an
import's side files as transformers reads them, in the import or in a run started from it."""
import json

import chat_templates as ct
from checkpoints.rundir import Run, generation_eos
from data.tokenizer import eos_id


def transformers_eos(hf_dir) -> list[int]:
    """The ids transformers' generate stops at for a model loaded from ``hf_dir``: its
    generation_config.json, else one made from config.json (GenerationMixin.adjust_generation_fn);
    one id is a list of one (_prepare_special_tokens)."""
    from transformers import GenerationConfig
    try:
        got = GenerationConfig.from_pretrained(hf_dir)
    except OSError:
        got = GenerationConfig.from_pretrained(hf_dir, config_file_name="config.json",
                                               _from_model_config=True)
    ids = got.eos_token_id
    return [] if ids is None else [ids] if isinstance(ids, int) else list(ids)


def imported(directory, family, hf_config, generation=None):
    """A run directory as an import leaves it (tokenizer.json, config.json, hf/ side files),
    opened without its checkpoints (nothing here reads them)."""
    tok = ct.write_tokenizer_dir(family, directory / "hf")
    (directory / "tokenizer.json").write_text(tok.to_str())
    (directory / "config.json").write_text(json.dumps({"checkpoint": {"restore_from": ""}}))
    (directory / "hf" / "config.json").write_text(json.dumps(hf_config))
    if generation is not None:
        (directory / "hf" / "generation_config.json").write_text(json.dumps(generation))
    return Run(directory, None, tok, "", None), tok


def test_stop_ids_are_what_transformers_generate_stops_at_and_the_tokenizers_eos(tmp_path):
    # Gemma 3: tokenizer_config.json's eos_token is <eos>; the reply ends at <end_of_turn>,
    # which only generation_config.json lists (config.json's text_config names <eos> alone)
    run, tok = imported(tmp_path / "gemma", "gemma3",
                        {"model_type": "gemma3", "text_config": {"eos_token_id": 1}},
                        {"bos_token_id": 2, "eos_token_id": [1, 4], "pad_token_id": 0})
    eos, eot = tok.token_to_id("<eos>"), tok.token_to_id("<end_of_turn>")
    assert (eos, eot) == (1, 4)
    assert run.eos == eos and transformers_eos(run.directory / "hf") == [eos, eot]
    assert run.stop_ids == (eos, eot)
    # Llama 3.1 Instruct: end of text, of message (an id this tokenizer lacks) and of turn; the
    # tokenizer's eos_token <|eot_id|> is among them
    run, tok = imported(tmp_path / "llama", "llama3", {"model_type": "llama", "eos_token_id": 4},
                        {"eos_token_id": [1, 399, 4]})
    assert tok.token_to_id("<|end_of_text|>") == 1 and tok.token_to_id("<|eot_id|>") == 4
    assert transformers_eos(run.directory / "hf") == [1, 399, 4]
    assert run.eos == 4 and run.stop_ids == (4, 1, 399)
    # one int; a generation config without eos_token_id (transformers: none, and config.json
    # is not read): the tokenizer's eos alone
    for generation, listed in (({"eos_token_id": 1}, [1]), ({"bos_token_id": 0}, [])):
        (run.directory / "hf" / "generation_config.json").write_text(json.dumps(generation))
        assert transformers_eos(run.directory / "hf") == listed
        assert generation_eos([run.directory / "hf"]) == listed
        assert Run(run.directory, None, tok, "", None).stop_ids == \
            tuple(dict.fromkeys([4, *listed]))
    # no generation_config.json: config.json's, its top level before its text_config's
    (run.directory / "hf" / "generation_config.json").unlink()
    for cfg, listed in (({"model_type": "gemma3", "text_config": {"eos_token_id": [1, 3]}},
                         [1, 3]),
                        ({"model_type": "gemma3", "eos_token_id": 2,
                          "text_config": {"eos_token_id": [1, 3]}}, [2])):
        (run.directory / "hf" / "config.json").write_text(json.dumps(cfg))
        assert transformers_eos(run.directory / "hf") == listed
        assert Run(run.directory, None, tok, "", None).stop_ids == \
            tuple(dict.fromkeys([4, *listed]))


def test_a_run_started_from_an_import_stops_where_the_import_does_and_a_bare_run_at_its_eos(
        tmp_path):
    imp, tok = imported(tmp_path / "import", "gemma3", {"model_type": "gemma3_text"},
                        {"eos_token_id": [1, 4]})
    sft = tmp_path / "sft"  # an SFT run from the import: its tokenizer copied, no hf/ of its own
    sft.mkdir()
    (sft / "tokenizer.json").write_text(tok.to_str())
    (sft / "config.json").write_text(json.dumps(
        {"checkpoint": {"restore_from": str(imp.directory / "checkpoints" / "0")}}))
    (imp.directory / "checkpoints" / "0").mkdir(parents=True)
    run = Run(sft, None, tok, "", None)
    assert run.eos == 1 and run.stop_ids == (1, 4)
    bare = tmp_path / "bare"  # trained from scratch: its config.json is not an HF config
    bare.mkdir()
    own = ct.tokenizer("smollm2")
    (bare / "tokenizer.json").write_text(own.to_str())
    (bare / "config.json").write_text(json.dumps({"checkpoint": {"restore_from": ""},
                                                  "model": {"eos_token_id": 7}}))
    run = Run(bare, None, own, "", None)
    assert run.stop_ids == (eos_id(own),) == (run.eos,)
