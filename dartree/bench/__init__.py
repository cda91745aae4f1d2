"""End-to-end benchmark: acceptance length and speedup of every method, measured side by side.

    dartree bench                                   # default models, default prompt sets
    dartree bench --prompts humaneval --limit 20 --budgets 16,32,64,auto --out bench/results/e2e

Protocol (DESIGN.md "Speed, honestly measured"; research/ALGORITHMS.md §7):

- τ of a response = its mean tokens committed per round, bonus included; τ of a method = mean over
  responses of that (as DFlash and DDTree define it). `tau_micro` = Σ tokens / Σ rounds too.
- TPOT of a response = decode time / new tokens (prefill excluded, batch 1). A method's TPOT =
  mean over responses; speedup = `ar` TPOT ÷ the method's TPOT, `ar` running through the same loop
  on the same prompts with the same max tokens (`speedup_total` uses Σ decode / Σ tokens instead).
- The external baseline, HF `generate` of the same model, dtype, threads and prompts
  (`hf_baseline.py`), is timed by the same rules; `speedup_hf` = its TPOT ÷ the method's.
- Every configuration (method × budget, HF generate) runs once on a warm-up prompt before anything
  is timed; the configurations then run interleaved prompt by prompt (HF generate and `ar` first),
  so a change of machine load hits all of them alike.
- At temperature 0 every output is checked equal to `ar`'s and, in float32, to HF generate's, token
  for token; a mismatch stops the run with `OutputMismatch`, naming the method and the prompt.
- With a chat model (a tokenizer with a chat template) the prompts are user messages of the
  template, except the stdlib set (code continuation); see `encode.py`.
- Stage times (draft, tree, verify, accept, commit) are per round; peak memory is CUDA's
  max_memory_allocated per call on a GPU, else the process's peak RSS (which never goes down).

Budgets: fixed ints; "auto", `SpeculativeDecoder(budget="auto")`, each round's size (and whether
the drafter runs) chosen by the decoder from its measured costs; "search" (`auto_budget`): the
verify latency as a function of tree size is measured once per target and device
(`measure_verify_latency`); for each candidate (budget, width) the drafter's own estimate of the
tokens a round commits, Σ over tree nodes of exp(path score) (DDTree Prop. 1, the root's exp(0) =
1 being the bonus), is averaged over calibration prompts, and the candidate with the largest
expected tokens per second = expected tokens / (verify latency + the other stages' time per round)
is run as a fixed budget.

Candidate sources: `--ngram off|on|both` runs the tree methods with the lookup's branches
(ngram=True, the decoder's default), without them, or both; method `ngram` verifies the lookup's
branches alone. Each row reports the accepted draft tokens by source (drafter, lookup, both).
llama.cpp runs plain and in each of its n-gram modes (`llamacpp_baseline.NgramMode`).

Prompt sets where context matters: `mtbench2` (two-turn chats whose second turn follows the
target's own first answer, `conversations.py`) and `edit` (change a function and return it whole,
`dartree.edits`), beside humaneval.

Modules: config (settings, configurations), encode (default sets, prompt ids), conversations
(two-turn sets' first answers), run (the run, the lossless check), hf_baseline (HF generate,
timed), llamacpp_baseline (llama.cpp, plain and n-gram), aggregate (rows -> measures), budget
(search), machine (what is recorded), report (JSON, table, plots), cli (`dartree bench`), floor
(each stage against the machine's copy and GEMM rates; `bench/floor.py`).
"""

from .aggregate import aggregate, auto_vs_sweep, best_budgets
from .budget import (AutoBudgetReport, Candidate, LatencyProfile, auto_budget, choose_budget,
                     measure_verify_latency)
from .cli import add_bench_parser, main
from .config import BenchSettings, RunConfig
from .encode import encode_prompts
from .report import format_table, write_plots, write_results
from .run import BenchResult, OutputMismatch, Progress, check_equal, run_benchmark

__all__ = ["AutoBudgetReport", "BenchResult", "BenchSettings", "Candidate", "LatencyProfile",
           "OutputMismatch", "Progress", "RunConfig", "add_bench_parser", "aggregate", "auto_budget",
           "auto_vs_sweep", "best_budgets", "check_equal", "choose_budget", "encode_prompts",
           "format_table", "main", "measure_verify_latency", "run_benchmark", "write_plots",
           "write_results"]
