"""Adapters that let other engines use a mooncaked node: a vLLM KV connector
(``vllm_connector``) and the parts of it that need no vLLM (``vllm_layout``,
``vllm_plan``, ``node_link``). Nothing of the daemon imports this package."""
