"""The evaluation harness behind `camkv eval` (quality against the full cache) and
`camkv bench` (speed and memory).

- arms: the arms compared (full, StreamingLLM, camkv settings) and the caches they make;
- loading: the one model loader of both commands;
- budgets: --budgets and the budgets that evict in a context;
- stream, passkey: the two quality tasks; ruler: RULER's synthetic tasks, ruler_scoring
  their score (no MLX), ruler_report their summary, tables and plot, ruler_export their
  prompts for other engines (--export-prompts);
- records: OUT/records.jsonl and the folder lock;
- sweep: the resumable run of `camkv eval`; cli: its flags and presets;
- report: summaries, tables and plots of the records;
- bench: `camkv bench`;
- texts, rdata: the real text the tasks read.
"""
