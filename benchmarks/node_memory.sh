#!/bin/bash
# Node memory during a run, every 3 s, as Ray's memory monitor counts it: used = MemTotal - MemAvailable (GiB),
# the shared memory in /dev/shm, the summed RSS of inductor's compile workers and of the python/Ray processes
# (the compile workers among them; RSS double-counts shared memory each process touched).
#
#     benchmarks/node_memory.sh LOG & WATCH=$!; python benchmarks/run.py ...; kill $WATCH
#
# The logs in benchmarks/results/node-memory/ were written so, beside the result file of the same name.
out=${1:?usage: node_memory.sh LOG}
while true; do
  used=$(awk '/MemTotal/{t=$2}/MemAvailable/{a=$2}END{printf "%.2f", (t-a)/1048576}' /proc/meminfo)
  shm=$(df -m /dev/shm | awk 'NR==2{printf "%.2f", $3/1024}')
  workers=$(ps -eo rss,args | grep -E "compile_worker|SubprocPool" | grep -v grep |
            awk '{s+=$1;n++}END{printf "%.2f GiB in %d", s/1048576, n}')
  python=$(ps -eo rss,args | grep -E "python|ray::" | grep -v grep | awk '{s+=$1;n++}END{printf "%.2f GiB in %d", s/1048576, n}')
  echo "$(date +%T) used ${used} GiB shm ${shm} GiB compile-workers ${workers} python ${python}" >> "$out"
  sleep 3
done
