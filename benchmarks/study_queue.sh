#!/usr/bin/env bash
# The long real runs of issues 40, 38 and 41 (about 25 CPU hours), one run at a time, in an order that survives a
# machine being replaced between sessions: every finished run's records are exported into docs/records and committed
# at once, and a new machine starts by copying the committed records back into runs/ (so `coretune bench` skips
# the finished runs, as it skips any run whose results.json holds test results or records that it diverged: a
# result too, committed like the others and never fitted again: to retry one after a code change, delete its
# committed record, then run `coretune bench SPEC --retry_diverged`). A run cut short on a machine that
# stays up resumes from its checkpoints/last.ckpt; on a new machine it starts again.
#
# An adversarial run (issue 38) is fitted, scored by benchmarks/robust_table.py and only then committed: its
# robust accuracy needs the checkpoint, which is not committed (a run directory does not survive a move), so a run
# is never recorded as finished without its robust_results*.json. The strength study (issue 41, part 2) fine-tunes
# checkpoints this queue pre-trains; a new machine pre-trains them again, and if a checkpoint comes out different
# from the one its committed runs used (strength_gain.py compares SHA-256), the queue stops and says so. Its last step
# draws the strength study's table and figure from every finished run and commits them (docs/img/strength_gain.png).
#
#   benchmarks/study_queue.sh MAIN     # MAIN: the checkout whose docs/records receive the records and the commits.
# Run it from a worktree of its own, so that editing MAIN never changes code under a running study:
#   git -C /work/main worktree add --detach /work/bench-wt main && cd /work/bench-wt
#   ln -s /work/main/.venv .venv && ln -s /work/main/runs runs && mkdir -p /work/main/runs /work/logs
# (.venv may be MAIN's: the queue puts its own src/ first on PYTHONPATH, so it runs this checkout's code.)
#   nohup setsid benchmarks/study_queue.sh /work/main > /work/logs/queue.log 2>&1 &
#   nohup benchmarks/pause_during_pytest.sh "$(cat runs/study_queue.pgid)" > /work/logs/guard.log 2>&1 &
# Move the worktree to newer code only while the queue is stopped. Re-running it resumes every step. It expects
# CIFAR-10 unpacked at /work/data/cifar10 (python ../shared/data/unpack.py cifar10 /work/data) and the shared
# checkpoint in ../shared/checkpoints.
set -uo pipefail

main() {  # the whole queue in one function: bash has read all of it before it runs, so editing the file is safe
  cd "$(dirname "$0")/.." || exit 1
  [ $# -eq 1 ] || { echo "usage: benchmarks/study_queue.sh MAIN  (the checkout that receives the records)"; exit 2; }
  MAIN=$(cd "$1" && pwd) && git -C "$MAIN" symbolic-ref -q HEAD >/dev/null \
    || { echo "$1: not a checkout on a branch (the records are committed there)"; exit 2; }
  BIN=.venv/bin
  export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"  # this checkout's code, whichever venv .venv is
  MEMORY=configs/bench/cifar10_cpu_10pct_memory.yaml
  ADV=configs/bench/cifar10_cpu_10pct_adversarial.yaml
  TABLE1=configs/bench/cifar10_cpu_10pct_table1.yaml
  LR01=configs/bench/cifar10_cpu_10pct_lr01.yaml
  STRENGTH=configs/bench/cifar10_cpu_strength.yaml
  STRENGTH_1PCT=configs/bench/cifar10_cpu_strength_1pct.yaml
  mkdir -p runs && [ -d runs ] || { echo "runs/ is missing (a symlink to a folder that does not exist?)"; exit 2; }
  exec 9>runs/.study_queue.lock
  flock -n 9 || { echo "another study_queue.sh is running (runs/.study_queue.lock)"; exit 1; }
  ps -o pgid= $$ | tr -d ' ' > runs/study_queue.pgid

  for spec in "$MEMORY" "$ADV" "$LR01" "$TABLE1" "$STRENGTH" "$STRENGTH_1PCT"; do prime "$spec"; done
  # Table 1's ce and core rows are the memory study's ce_b64 and core_b64 (argument for argument; the spec's header)
  for pair in ce:ce_b64 core:core_b64; do
    for seed in 0 1 2; do
      local from to
      from="runs/bench/$(name_of "$MEMORY")/cifar10/${pair##*:}/frac0.1/seed$seed"
      to="runs/bench/$(name_of "$TABLE1")/cifar10/${pair%%:*}/frac0.1/seed$seed"
      [ -e "$to" ] || { mkdir -p "$(dirname "$to")" && cp -r "$from" "$to"; }
      settled "$TABLE1" cifar10 "${pair%%:*}" "$seed" || {  # committed under Table 1's name: its table, from records
        say "stopped: Table 1's ${pair%%:*} seed $seed is neither committed nor a finished copy of $from"; exit 1
      }
    done
  done

  # Issue 40: the batch-16 rows, seed by seed, each pair (core, core + memory) together
  for seed in 1 2; do
    for obj in core_b16 core_mem4096_b16 ce_b16; do fit "$MEMORY" "$obj" "$seed" cifar10 || failed; done
  done

  # Issue 38: the ℓ∞-trained rows and the undefended CE, seed by seed
  for seed in 0 1 2; do
    for obj in ce at_ce_linf at_ce_con_linf at_core_linf; do adversarial "$obj" "$seed" || failed; done
  done

  same_precision || exit 1
  # Issue 41, part 3: the lr 0.1 check of docs/results.md section 7, clipped and not (the second collapses: a result),
  # then the clipped config over a 30-epoch schedule, Core-tuning and CE-tuning
  for obj in core_clip core_noclip core_clip_e30 ce_clip_e30; do fit "$LR01" "$obj" 0 cifar10 || failed; done

  # Issue 41, part 1: Table 1, seed by seed (ce and core are copied above); ce_mix and Bi-tuning first, the rows the
  # practical answer of docs/results.md turns on
  for seed in 0 1 2; do
    for obj in ce_mix bi_tuning l2sp delta bss rifle scl mm manifold_mixup; do
      fit "$TABLE1" "$obj" "$seed" cifar10 || failed
    done
  done

  # Issue 41, part 2, column by column: a checkpoint is pre-trained (again, on a new machine: the pre-training is
  # deterministic here, and a file that comes out different stops the queue) only when a run of its column is left,
  # and scored (kNN, linear probe) before its fine-tunings. The 1% spec's floor runs beside the 10% one.
  strength_column random - || exit 1
  strength_column random - "$STRENGTH_1PCT" || exit 1
  strength_column simclr_in20 - || exit 1
  strength_column simclr_e5 simclr || exit 1
  strength_column simclr_e15 simclr || exit 1
  strength_column moco_v2_e15 moco_v2 || exit 1
  # The 1% rows of the strongest checkpoint by kNN, which evaluate names once every column is scored (the 1% spec
  # lists every column, so nothing waits for a person)
  score || exit 1
  local strongest
  strongest=$(sed -n 's/^strongest by kNN top-1: \([A-Za-z0-9_]*\).*/\1/p' runs/strength_eval.txt)
  [ -n "$strongest" ] || { say "stopped before the 1% rows: strength_gain.py evaluate named no strongest checkpoint"; exit 1; }
  local maker=-
  case $strongest in simclr_e*) maker=simclr ;; moco_v2_e*) maker=moco_v2 ;; esac
  strength_column "$strongest" "$maker" "$STRENGTH_1PCT" || exit 1
  local dir
  for dir in runs/pretrain/cifar10-simclr-r18-32px runs/pretrain/cifar10-moco-r18-32px; do
    record_pretraining "$dir"  # also a pre-training made before this step existed, whose columns are all done
  done
  plot || failed
  if [ "$FAILURES" -gt 0 ]; then
    say "queue finished, but $FAILURES run(s) or step(s) failed (FAILED lines above): re-run the queue to retry them"; exit 1
  fi
  say "queue finished"
}

say() { echo "[$(date '+%F %T')] $*"; }

FAILURES=0
failed() { FAILURES=$((FAILURES + 1)); }  # a run that failed (not diverged): the queue goes on, and says so at the end

# Issue 41's committed runs trained under bf16 autocast, coretune's default on a CPU with AVX512-BF16 or AMX; a
# machine without either would train the rest in float32, and the tables would mix the two unnoticed.
same_precision() {
  local here
  here=$("$BIN/python" -c 'from coretune.engine import default_precision; print(default_precision())' | tail -n 1)
  [ "$here" = bf16-mixed ] && return 0
  say "stopped before issue 41's runs: coretune's default precision here is '${here:-unknown (the check failed)}',"
  say "and its committed runs (the memory study's ce and core too) trained in bf16-mixed: run the queue on a machine"
  say "with AVX512-BF16 or AMX"
  return 1
}

name_of() { sed -n 's/^name: *//p' "$1"; }

# Copy the committed records of a spec into its output folder (never overwriting a run directory's own files).
prime() {
  local name; name=$(name_of "$1")
  [ -d "$MAIN/docs/records/$name" ] || return 0
  mkdir -p "runs/bench/$name" && cp -rn "$MAIN/docs/records/$name/." "runs/bench/$name/"
}

# Commit PATH of MAIN alone (nothing else staged there is swept in); retried, since a session may hold MAIN's index.
commit() {
  local attempt
  [ -e "$MAIN/$1" ] || return 0  # nothing exported yet
  for attempt in 1 2 3 4 5; do
    if git -C "$MAIN" symbolic-ref -q HEAD >/dev/null && git -C "$MAIN" add "$1" && { git -C "$MAIN" diff --cached --quiet -- "$1" \
        || git -C "$MAIN" commit -q -m "$2" -- "$1"; }; then
      return 0
    fi
    say "git add/commit of $1 failed or MAIN is not on a branch (attempt $attempt); retrying in 30 s"; sleep 30
  done
  say "FAILED to commit $1: commit it by hand"; return 1
}

# Export the spec's finished runs of OBJECTIVE and SEED into MAIN/docs/records and commit them.
record() {  # SPEC MESSAGE OBJECTIVE SEED [DATASET]
  local name; name=$(name_of "$1")
  "$BIN/coretune" bench "$1" --only_objectives "[$3]" --only_seeds "[$4]" ${5:+--only_datasets "[$5]"} \
    --export "$MAIN/docs/records/$name" >/dev/null || { say "export of $name $3 seed $4 failed"; return 1; }
  commit "docs/records/$name" "records: $name, $2" && say "recorded: $name, $2"
}

# A run's folder below the spec's output (the specs here have one label fraction each)
run_path() {  # SPEC DATASET OBJECTIVE SEED
  echo "$(name_of "$1")/$2/$3/frac$(sed -n 's/^label_fractions: *\[ *\([0-9.]*\) *\].*/\1/p' "$1")/seed$4"
}

finished() {  # SPEC DATASET OBJECTIVE SEED: the run's results.json holds test results (bench's own criterion)
  grep -qs '"test":' "runs/bench/$(run_path "$@")/results.json"
}

diverged() {  # SPEC DATASET OBJECTIVE SEED: the run's committed results.json records that it diverged (a result)
  git -C "$MAIN" show "HEAD:docs/records/$(run_path "$@")/results.json" 2>/dev/null | grep -q '"diverged"'
}

recorded() {  # SPEC DATASET OBJECTIVE SEED [FILE]: the run's FILE (default results.json) is committed in MAIN
  git -C "$MAIN" cat-file -e "HEAD:docs/records/$(run_path "$1" "$2" "$3" "$4")/${5:-results.json}" 2>/dev/null
}

settled() {  # SPEC DATASET OBJECTIVE SEED: recorded, after recording it if it finished here without being recorded
  recorded "$@" && return 0
  finished "$@" || return 1
  record "$1" "$2/$3/seed$4" "$3" "$4" "$2" && recorded "$@"
}

fit() {  # SPEC OBJECTIVE SEED [DATASET]: the spec's runs of that objective and seed (one, or one per dataset column)
  [ -n "${4:-}" ] && settled "$1" "$4" "$2" "$3" && return 0
  say "fit $(name_of "$1") $2 seed $3"
  "$BIN/coretune" bench "$1" --only_objectives "[$2]" --only_seeds "[$3]" ${4:+--only_datasets "[$4]"}
  local status=$?
  if [ $status != 0 ] && [ -n "${4:-}" ] && grep -qs '"diverged"' "runs/bench/$(run_path "$1" "$4" "$2" "$3")/results.json"; then
    say "DIVERGED: $(name_of "$1") $2 seed $3 (recorded: a result, not fitted again)"; status=0
  fi
  [ $status = 0 ] || say "FAILED: $(name_of "$1") $2 seed $3 (the runs that finished or diverged are recorded)"
  record "$1" "${4:-every column}/$2/seed$3" "$2" "$3" "${4:-}"
  return $status
}

adversarial() {  # OBJECTIVE SEED: fit, score (PGD-10 on all; torchattacks and AutoAttack on seed 0), then record
  local run file done=1 scored=1 expected=(robust_results.json)
  run="runs/bench/$(run_path "$ADV" cifar10 "$1" "$2")"
  [ "$2" = 0 ] && expected+=(robust_results_autoattack.json)
  [ "$1" = ce ] && expected+=(robust_results_sanity_linf8.json)
  for file in results.json "${expected[@]}"; do recorded "$ADV" cifar10 "$1" "$2" "$file" || done=0; done
  [ $done = 1 ] && return 0
  diverged "$ADV" cifar10 "$1" "$2" && return 0  # recorded as diverged: nothing to score
  for file in "${expected[@]}"; do [ -f "$run/$file" ] || scored=0; done
  if finished "$ADV" cifar10 "$1" "$2" && [ $scored = 1 ]; then
    record "$ADV" "cifar10/$1/frac0.1/seed$2 (fit and robust accuracy)" "$1" "$2"
    return
  fi
  if finished "$ADV" cifar10 "$1" "$2" && [ ! -f "$run/checkpoints/last.ckpt" ]; then
    say "$run: fitted, not fully scored, and its checkpoint is gone: fitting it again"
    mv "$run" "$run.unscored-$(date +%s)"
  fi
  say "fit + evaluate adversarial $1 seed $2"
  if ! "$BIN/coretune" bench "$ADV" --only_objectives "[$1]" --only_seeds "[$2]"; then
    if grep -qs '"diverged"' "$run/results.json"; then
      say "DIVERGED: $1 seed $2 (recorded, not scored)"
      record "$ADV" "cifar10/$1/frac0.1/seed$2 (diverged)" "$1" "$2"
      return  # a result
    fi
    say "FAILED fit: $1 seed $2"
    return 1
  fi
  "$BIN/python" benchmarks/robust_table.py evaluate "$ADV" --only_objectives "$1" --only_seeds "$2" \
    --autoattack_seeds 0 --referee_seeds 0 || { say "FAILED evaluate: $1 seed $2"; return 1; }
  for file in "${expected[@]}"; do
    [ -f "$run/$file" ] || { say "FAILED evaluate: $run/$file missing"; return 1; }
  done
  record "$ADV" "cifar10/$1/frac0.1/seed$2 (fit and robust accuracy)" "$1" "$2"
}

pretrain() {  # METHOD: 15 epochs at 32 px on CIFAR-10's training images, no labels (the strength spec's header)
  local dir snaps extra=()
  case $1 in
    simclr) dir=runs/pretrain/cifar10-simclr-r18-32px snaps='[5, 15]' ;;
    moco_v2) dir=runs/pretrain/cifar10-moco-r18-32px snaps='[15]' extra=(--model.queue_size 4096) ;;
  esac
  if [ ! -f "$dir/pretrained-epoch15.pth.tar" ]; then
    local holder  # a pre-training started by hand (the spec's header) and still running: coretune's own claim test
    holder=$("$BIN/python" -c 'import sys; from coretune.runs.claim import live_claim; c = live_claim(sys.argv[1])
print(c.where() if c else "")' "$dir" 2>/dev/null | tail -n 1)
    if [ -n "$holder" ]; then
      say "stopped: $dir is in use by $holder (its fit.pid): let that pre-training finish or stop it, then"
      say "re-run the queue"
      return 1
    fi
    rm -rf "$dir"  # from the start, never resumed: the file must come out as the committed fine-tunings' did
    say "pretrain $1"
    mkdir -p "$dir" && git rev-parse HEAD > "$dir/commit.txt" 2>/dev/null  # the code that makes the checkpoint
    "$BIN/coretune" pretrain --method "$1" --model.backbone resnet18 "${extra[@]}" --data.root /work/data/cifar10/train \
      --data.image_size 32 --data.batch_size 256 --trainer.max_epochs 15 --snapshot_epochs "$snaps" --seed 0 \
      --trainer.precision bf16-mixed --trainer.enable_progress_bar false --run_dir "$dir" \
      || { say "FAILED: pretrain $1"; return 1; }
  fi
  record_pretraining "$dir" || say "the queue goes on; commit $dir's records by hand (docs/records/cifar10-cpu-strength-pretrain)"
}

# A finished pre-training's records (its settings, loss curve, timings, and the commit of the code that ran it: the
# checkpoint itself is not committed, and a new machine makes it again), committed once.
record_pretraining() {  # DIR
  local to file
  to="docs/records/cifar10-cpu-strength-pretrain/$(basename "$1")"
  git -C "$MAIN" cat-file -e "HEAD:$to/results.json" 2>/dev/null && return 0
  [ -f "$1/results.json" ] || return 0  # not made here, or not finished
  mkdir -p "$MAIN/$to"
  for file in config.yaml metrics.csv results.json commit.txt; do [ -f "$1/$file" ] && cp "$1/$file" "$MAIN/$to/"; done
  [ -f "$1/commit.txt" ] || echo "unknown: made before the queue noted it (recorded at $(git rev-parse HEAD 2>/dev/null))" \
    > "$MAIN/$to/commit.txt"
  commit "$to" "records: strength study, pre-training $(basename "$1")"
}

# kNN and linear probe of the strength spec's columns (all, or those named), committed. A checkpoint re-made here
# that differs from the file its committed scores (and fine-tunings) used stops the queue, nothing overwritten.
score() {  # [COLUMN...]
  local scores=docs/records/cifar10-cpu-strength-eval
  local only=()
  [ $# -gt 0 ] && only=(--only_datasets "$@")
  "$BIN/python" benchmarks/strength_gain.py evaluate "$STRENGTH" "$STRENGTH_1PCT" --eval_dir "$MAIN/$scores" --refuse_stale \
    "${only[@]}" | tee runs/strength_eval.txt || {
    say "stopped at strength_gain.py evaluate $* (above). If a checkpoint differs from the one scored (re-made on"
    say "another machine), move the runs and the two eval files of EVERY column its pre-training made (simclr:"
    say "simclr_e5 and simclr_e15; moco_v2: moco_v2_e15; their 1% runs too) out of docs/records and runs/bench,"
    say "commit, and re-run the queue (moving one column alone stops the queue again at the other)"
    return 1
  }
  commit "$scores" "records: strength study, kNN and linear probe of ${*:-every checkpoint}"
}

# The strength study's table and figure from every finished run and score (docs/img/strength_gain.png; the table
# beside the scores), committed: the numbers and the picture results.md describes, remade at each pass.
plot() {
  local scores=docs/records/cifar10-cpu-strength-eval
  "$BIN/python" benchmarks/strength_gain.py plot "$STRENGTH" "$STRENGTH_1PCT" --eval_dir "$MAIN/$scores" \
    --figure "$MAIN/docs/img/strength_gain.png" --markdown "$MAIN/$scores/gains.md" --footnote "simclr_in20 (the \
shared ImageNet20 SimCLR) was pre-trained at 64 px and is scored frozen at 32 px with its 64-px BatchNorm statistics: \
its kNN understates it (52.70% at 64 px against 46.29% at 32 px: cifar10-cpu-strength-eval/sensitivity/). 1% of the labels: the floor (random) and the strongest checkpoint by kNN only." \
    || { say "FAILED: strength_gain.py plot (above)"; return 1; }
  local status=0
  commit "$scores/gains.md" "records: strength study, the gains table" || status=1
  commit docs/img/strength_gain.png "strength study: the figure of the gains (docs/img/strength_gain.png)" || status=1
  return $status
}

# One column of a strength spec (default the 10% one): unless its runs are all finished and it is scored, make its
# checkpoint (MAKER: a pre-training, or - for none), score it, then fine-tune it by every method and seed.
strength_column() {  # COLUMN MAKER [SPEC]
  local column=$1 maker=$2 spec=${3:-$STRENGTH} obj seed todo=0
  local scores="$MAIN/docs/records/cifar10-cpu-strength-eval"
  for obj in ce ce_mix core; do for seed in 0 1 2; do settled "$spec" "$column" "$obj" "$seed" || todo=1; done; done
  [ $todo = 0 ] && [ -f "$scores/$column-knn.json" ] && [ -f "$scores/$column-linear.json" ] && return 0
  if [ "$maker" != - ]; then pretrain "$maker" || return 1; fi
  score "$column" || return 1
  for seed in 0 1 2; do
    for obj in ce ce_mix core; do fit "$spec" "$obj" "$seed" "$column" || failed; done  # the others go on
  done
}

main "$@"; exit $?
