"""Interoperability with the Hugging Face ecosystem.

    llama.py           the name/config mapping between our reference Transformer and `LlamaForCausalLM`
    hf_export.py       checkpoint -> Hugging Face model folder (`speedtronic export ... --format hf`)
    hf_import.py       Hugging Face Llama folder -> our Transformer's weights (`model.init_from`)
    byte_tokenizer.py  the byte-level tokenizer as a tokenizer.json any `transformers` user can load
    hf_folder.py       sampling from an exported folder, honouring its generation_config.json
    hub_upload.py      `--push-to-hub`: create the repo and upload the folder

None of these modules imports `transformers`: export, import and sampling of Llama folders work without
it. They read and write safetensors only (never pickles).
"""
