"""D's runtime, in each decode worker process: the pull thread and its lanes (``pull_loop.py``,
``pull_lanes.py``), the P ranks that did not answer (``pull_suspects.py``), P's rank tables (``rank_tables.py``,
also used by the proxy's abandons) and how a finished pull is logged (``pull_log.py``). What it decides lives in
:mod:`vllm_kvp2p.lifecycle.consumer`."""
