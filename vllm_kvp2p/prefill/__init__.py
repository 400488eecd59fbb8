"""P's runtime, in each prefill worker process: the holds it keeps and the side channel D talks to
(``hold_service.py``). What it decides lives in :mod:`vllm_kvp2p.lifecycle.producer`."""
