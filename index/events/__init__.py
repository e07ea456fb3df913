"""KV events in the vLLM/SGLang wire format: event data types, codec, subscriber and publisher."""
