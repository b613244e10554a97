"""The model engines, shared by every process that runs a model (prefill, decode, coupled, profile, bench).

    reference.py   the plain single-sequence forward (transformers' own cache): what the others are tested against
    batch.py       continuous batching for decode: one forward per iteration for every running request
    layerwise.py   layer-by-layer prefill: prefix loaded ahead, each layer's new KV streamed out, chunks, pipeline
"""
