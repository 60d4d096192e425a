"""Interoperability with the Hugging Face ecosystem.

    hf_export.py       checkpoint -> Hugging Face model folder (`speedtronic export ... --format hf`)
    byte_tokenizer.py  the byte-level tokenizer as a tokenizer.json any `transformers` user can load
    hf_folder.py       sampling from an exported folder, honouring its generation_config.json
    hub_upload.py      `--push-to-hub`: create the repo and upload the folder

The name/config mapping between our reference Transformer and `LlamaForCausalLM` lives next to the
model (engine/llama.py), and so does reading a folder into a built model for `model.init_from`
(engine/pretrained.py): model building applies it, so training never reaches up into this package.

None of these modules imports `transformers`: export, import and sampling of Llama folders work without
it. They read and write safetensors only (never pickles).
"""
