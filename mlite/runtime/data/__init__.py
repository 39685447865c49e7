"""Data for the trainers: `packed` (the batch format), `demo` (generated tasks with checkable answers),
`tokenizer` (the demo's BPE tokenizer), `sft` (messages files -> masked samples + report), `packing`
(samples -> each rank's micro-batches per step, resumable)."""
