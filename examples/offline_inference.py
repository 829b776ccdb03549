"""The vLLM quick-start, with only the import changed. MODEL: a local HF dir or None (embedded)."""

import sys

from tandem import LLM, SamplingParams

MODEL = sys.argv[1] if len(sys.argv) > 1 else None

llm = LLM(model=MODEL, tensor_parallel_size=1, dtype="float16",
          max_num_batched_tokens=8192, max_num_seqs=256)
prompts = ["Hello, my name is", "The capital of France is"]
sampling_params = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=100)
outputs = llm.generate(prompts, sampling_params)
for output in outputs:
    print(f"Prompt: {output.prompt!r}, Generated: {output.outputs[0].text!r}")
