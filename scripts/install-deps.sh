#!/usr/bin/env bash
# Install the external programs the Redfence test suite and `redfence dev` need:
#   - redis-server          (Debian package: redis-server)
#   - Postgres server bins  (Debian package: postgresql)
#   - a C compiler          (Debian packages: gcc libc6-dev; needed by `go test -race`)
#   - with --bench: etcd    (Debian package: etcd-server; the peer `make bench` measures)
#
# Idempotent: when everything is present it only prints what it found (no apt-get
# update). Installs only as root on Debian/Ubuntu (apt-get); otherwise it names what
# is missing and exits 1. System services started by the packages' postinst scripts
# are stopped and disabled: tests start their own servers on free ports.
set -euo pipefail

log() { printf 'install-deps: %s\n' "$*"; }

bench=0
for arg in "$@"; do
  case "$arg" in
    --bench) bench=1 ;;
    *) log "unknown argument: $arg (known: --bench)" >&2; exit 2 ;;
  esac
done

missing_pkgs=()   # Debian packages to install
missing_desc=()   # human-readable names of what is missing

# --- redis-server ----------------------------------------------------------
if redis_bin="$(command -v redis-server 2>/dev/null)"; then
  log "redis-server: found ${redis_bin}"
else
  missing_pkgs+=(redis-server)
  missing_desc+=("redis-server (Debian/Ubuntu: redis-server, macOS: brew install redis)")
fi

# --- postgres server binaries --------------------------------------------
find_postgres() {
  local p
  for p in /usr/lib/postgresql/*/bin/postgres; do
    if [[ -x "$p" ]]; then printf '%s\n' "$p"; return 0; fi
  done
  command -v postgres 2>/dev/null
}
if pg_bin="$(find_postgres)"; then
  log "postgres: found ${pg_bin}"
else
  missing_pkgs+=(postgresql)
  missing_desc+=("postgres server binaries (Debian/Ubuntu: postgresql, macOS: brew install postgresql@15)")
fi

# --- C compiler for the race detector ------------------------------------
if cc_bin="$(command -v gcc 2>/dev/null || command -v cc 2>/dev/null)"; then
  log "c compiler (for go test -race): found ${cc_bin}"
else
  missing_pkgs+=(gcc libc6-dev)
  missing_desc+=("a C compiler for go test -race (Debian/Ubuntu: gcc libc6-dev)")
fi

# --- etcd, for the benchmark only -----------------------------------------
if [[ $bench -eq 1 ]]; then
  if etcd_bin="$(command -v etcd 2>/dev/null)"; then
    log "etcd: found ${etcd_bin}"
  else
    missing_pkgs+=(etcd-server)
    missing_desc+=("etcd (Debian/Ubuntu: etcd-server, macOS: brew install etcd)")
  fi
fi

if [[ ${#missing_pkgs[@]} -eq 0 ]]; then
  exit 0
fi

# --- something is missing --------------------------------------------------
if [[ "$(id -u)" -ne 0 ]] || ! command -v apt-get >/dev/null 2>&1; then
  log "ERROR: missing dependencies; please install:" >&2
  for d in "${missing_desc[@]}"; do
    printf '  - %s\n' "$d" >&2
  done
  if command -v apt-get >/dev/null 2>&1; then
    printf '  e.g. sudo apt-get install -y --no-install-recommends %s\n' "${missing_pkgs[*]}" >&2
  fi
  exit 1
fi

# Services we may cause to be started (only those whose package we install).
services=()
for p in "${missing_pkgs[@]}"; do
  case "$p" in
    redis-server) services+=(redis-server) ;;
    postgresql)   services+=(postgresql) ;;
    etcd-server)  services+=(etcd) ;;
  esac
done

# Keep postinst scripts from starting services at all where possible: a
# policy-rc.d returning 101 makes invoke-rc.d skip starts. Only if none exists.
policy=/usr/sbin/policy-rc.d
created_policy=0
if [[ ! -e "$policy" ]]; then
  printf '#!/bin/sh\nexit 101\n' >"$policy"
  chmod 755 "$policy"
  created_policy=1
fi
cleanup() { if [[ $created_policy -eq 1 ]]; then rm -f "$policy"; fi; }
trap cleanup EXIT

log "installing: ${missing_pkgs[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends "${missing_pkgs[@]}" >/dev/null

# Whatever postinst did, make sure the system instances are stopped and
# won't come back on boot: tests must not depend on ports 6379/5432.
for svc in "${services[@]}"; do
  if command -v systemctl >/dev/null 2>&1 && [[ -d /run/systemd/system ]]; then
    systemctl disable --now "$svc" >/dev/null 2>&1 || true
  fi
  service "$svc" stop >/dev/null 2>&1 || true
  if command -v update-rc.d >/dev/null 2>&1; then
    update-rc.d "$svc" disable >/dev/null 2>&1 || true
  fi
  log "${svc}: system service stopped and disabled"
done

# Report what we now have.
for p in "${missing_pkgs[@]}"; do
  case "$p" in
    redis-server)
      command -v redis-server >/dev/null 2>&1 || { log "ERROR: redis-server still not found" >&2; exit 1; }
      log "redis-server: installed $(command -v redis-server)" ;;
    postgresql)
      pg_bin="$(find_postgres)" || { log "ERROR: postgres still not found" >&2; exit 1; }
      log "postgres: installed ${pg_bin}" ;;
    gcc)
      log "c compiler: installed $(command -v gcc)" ;;
    etcd-server)
      command -v etcd >/dev/null 2>&1 || { log "ERROR: etcd still not found" >&2; exit 1; }
      log "etcd: installed $(command -v etcd)" ;;
  esac
done
