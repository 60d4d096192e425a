"""Interoperability with the Hugging Face ecosystem.

    hf_export.py       checkpoint -> Hugging Face model folder (`speedtronic export ... --format hf`)
    byte_tokenizer.py  the byte-level tokenizer as a tokenizer.json any `transformers` user can load
    hf_folder.py       sampling from an exported folder, honouring its generation_config.json
    hub_upload.py      `--push-to-hub`: create the repo and upload the folder
    lm_eval_harness.py the LM Evaluation Harness on a checkpoint (`speedtronic eval --harness`; the
                       optional lm-eval extra)

The name/config mapping between our reference Transformer and `LlamaForCausalLM` lives next to the
model (engine/llama.py), and so does reading a folder into a built model for `model.init_from`
(engine/pretrained.py): model building applies it, so training never reaches up into this package.

None of these modules imports `transformers`: export, import and sampling of Llama folders work without
it. They read and write safetensors only (never pickles).
"""


def require_lm_eval() -> None:
    """Raise a ConfigError (exit 2) naming the extra when the LM Evaluation Harness is not installed."""
    import importlib.util

    from speedtronic.errors import ConfigError

    if importlib.util.find_spec("lm_eval") is None:
        raise ConfigError(
            "--harness: the lm-eval extra is not installed; pip install 'speedtronic-lm[lm-eval]' (lm_eval>=0.4)"
        )
