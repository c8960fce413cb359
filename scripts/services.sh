#!/usr/bin/env bash
# Start PostgreSQL, Redis and RabbitMQ on loopback if any of them is down (this machine kind's commands).
# Bounded waits: a port (PostgreSQL, Redis) or `rabbitmqctl status` answering, about a minute each.
set -u
up() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }
wait_port() { for _ in $(seq 1 60); do up "$1" && return 0; sleep 1; done; echo "service on port $1 did not come up" >&2; return 1; }

if ! up 5432; then
  echo "starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start || true
  wait_port 5432 || exit 1
fi
if ! up 6379; then
  echo "starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log || true
  wait_port 6379 || exit 1
fi
# RabbitMQ: the amqp broker tests make a vhost of their own on it (and skip when it is down)
rabbit_ready() { timeout 10 rabbitmqctl -q status >/dev/null 2>&1 && up 5672; }
if ! up 5672; then
  if command -v rabbitmq-server >/dev/null; then
    echo "starting RabbitMQ"
    rabbitmq-server -detached || true
    ok=1
    for _ in $(seq 1 60); do rabbit_ready && { ok=0; break; }; sleep 1; done  # bounded: about 60-90 s
    [ "$ok" -eq 0 ] || echo "RabbitMQ did not come up (the amqp broker tests will skip; continuing)" >&2
  fi
fi
exit 0
