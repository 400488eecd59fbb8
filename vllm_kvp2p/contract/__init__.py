"""What P, D and the proxy share: the typed messages (``protocol.py``), the side channel's ZMQ transport
(``side_channel.py``), the shared secret (``auth.py``), an instance's identity and pairing key (``identity.py``,
``pairing_key.py``) and the operator's settings (``config.py``, ``config_reference.py``). Imports no vLLM and no
torch."""
