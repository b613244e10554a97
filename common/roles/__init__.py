"""The worker roles: what a prefill or a decode instance does, on NATS, around a loaded model.

    prefill.py, prefill_config.py   the prefill role: queue, pulls, layer-wise prefill, the streamed handoff
    handoff.py, pipeline.py         its KV handoff to the decode node, and the chunked pipeline between stages
    decode.py, decode_config.py     the decode role: late check, KV room, the continuous batch, tokens out

services/prefill and services/decode each run one role in a process; services/coupled runs both on one
model. The roles import the engines (common/engine) and the decision floor (common/decide), never a service.
"""
