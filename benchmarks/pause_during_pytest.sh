#!/usr/bin/env bash
# Pause a long study (SIGSTOP to its process group) while any pytest runs on this machine, resume it after: on 2
# cores two torch jobs slow each other 3-10x, so a test run pauses the study instead of both crawling (and the
# study's timings stay its own). PGID: the process group of benchmarks/study_queue.sh started with setsid, which the
# queue writes to runs/study_queue.pgid. If this guard ends (killed, or the study finished), the study runs on.
#   nohup benchmarks/pause_during_pytest.sh "$(cat runs/study_queue.pgid)" > /work/logs/guard.log 2>&1 &
set -u
pgid=${1:?usage: pause_during_pytest.sh PGID}
paused=0
trap 'kill -CONT -- "-$pgid" 2>/dev/null; exit' EXIT INT TERM HUP
while kill -0 -- "-$pgid" 2>/dev/null; do
  if pgrep -f 'python.* -m pytest|bin/pytest' >/dev/null; then
    [ $paused = 0 ] && kill -STOP -- "-$pgid" && paused=1 && echo "[$(date '+%F %T')] pytest running: paused $pgid"
  elif [ $paused = 1 ]; then
    kill -CONT -- "-$pgid" && paused=0 && echo "[$(date '+%F %T')] resumed $pgid"
  fi
  sleep 5
done
