#!/usr/bin/env bash
# Makes sure PostgreSQL (127.0.0.1:5432) and Redis (127.0.0.1:6379) answer, starting
# them when they are down. Under CI=true an unreachable service is a failure, never a skip.
set -u

pg_up()    { pg_isready -q -h 127.0.0.1 -p 5432 >/dev/null 2>&1; }
redis_up() { redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; }

wait_for() {  # name, check-function
  for _ in $(seq 1 30); do "$2" && return 0; sleep 1; done
  return 1
}

if ! pg_up; then
  echo "PostgreSQL is down; starting it"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n 1)" main start || true
  wait_for postgres pg_up || true
fi
if ! redis_up; then
  echo "Redis is down; starting it"
  redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no || true
  wait_for redis redis_up || true
fi

status=0
pg_up    && echo "PostgreSQL: up" || { echo "PostgreSQL: UNREACHABLE on 127.0.0.1:5432"; status=1; }
redis_up && echo "Redis: up"      || { echo "Redis: UNREACHABLE on 127.0.0.1:6379"; status=1; }
if [[ $status -ne 0 && "${CI:-}" == "true" ]]; then
  echo "CI=true: PostgreSQL and Redis are required" >&2
  exit 1
fi
exit 0
