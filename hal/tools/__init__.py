"""The tools behind the `hal` command, apart from the library.

- `hal.tools.bench`: `hal bench`, the weight-sync benchmarks and their presets.
- `hal.tools.demo`, `hal.tools.demo_ray`: `hal demo` and `hal demo --ray`; `hal.tools.demo_rl`
  (engine, prompts, REINFORCE step, engine-trainer comparison) and `hal.tools.demo_plot` (the PNG).
- `hal.tools.tiny_model`: tiny local Llama / Qwen2 models (tied or not) for the demo,
  the tests and the benchmarks; imports transformers inside its functions.
- `hal.tools.vllm_bench_worker`: the vLLM worker extension `hal bench --engine vllm` loads.

What a trainer or an engine imports (`hal`, `hal.backends`, `hal.kernels`, `hal.sync`,
`hal.integrations`) never imports this package (tests/test_layers.py).
"""
