"""dartree's drafters inside serving engines, as plug-ins (no fork of the engine).

    chains    engine-agnostic: per-request drafter state keyed by committed tokens, and one draft
              chain per request from what the engine's verify pass computed (`ChainDrafter`)
    vllm      a vLLM ``custom_class`` speculative proposer over `ChainDrafter` (chains only:
              vLLM verifies chains), and its ``vllm.general_plugins`` entry point
    sglang_tree  dartree's `DraftTree` -> SGLang's verify arrays (mask, positions, retrieve_*),
              and SGLang's greedy walk over them, in plain torch (no SGLang import)
    sglang    the ``DARTREE`` speculative algorithm for SGLang (``sglang.srt.plugins`` entry
              point); sglang_worker: its worker (GPU only: SGLang does not serve on a CPU)
    target_io an engine's model as a drafter's target (embedding, LM head, config)

Nothing here imports an engine at import time of ``dartree``; each engine module imports its
engine when it is imported itself.
"""
