# Redfence build, test and dev entry points. Run `make help` for the list.
SHELL := /bin/bash
.DEFAULT_GOAL := help

# Go may not be on PATH (e.g. in CI): add the standard install dir and GOPATH/bin.
GO_ROOT_BIN := /usr/local/go/bin
GOPATH_DIR  := $(shell PATH="$(GO_ROOT_BIN):$$PATH" go env GOPATH 2>/dev/null)
export PATH := $(GO_ROOT_BIN):$(if $(GOPATH_DIR),$(GOPATH_DIR)/bin:)$(PATH)

# Version stamped into the binary (override: make build VERSION=1.2.3).
VERSION ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS := -X main.version=$(VERSION)

BIN       := bin/redfence
ARGS      ?=
TESTFLAGS ?=

.PHONY: help deps build dev test test-ts chaos fmt-check cover clean bench bench-quick bench-deps bench-micro

## help:      list targets
help:
	@sed -n 's/^## //p' $(MAKEFILE_LIST)

## deps:      install missing redis-server / postgres / gcc (scripts/install-deps.sh)
deps:
	@bash scripts/install-deps.sh

## build:     build bin/redfence with the version stamped in
build:
	go build -ldflags "$(LDFLAGS)" -o $(BIN) ./cmd/redfence

## dev:       build and run a local dev stack (extra args via ARGS=...)
dev: deps build
	./$(BIN) dev $(ARGS)

## test:      full suite: go vet (also for macOS; Windows builds of the libraries) + go test -race (extra flags via TESTFLAGS=...), then test-ts
test: deps
	go vet ./...
	GOOS=darwin GOARCH=arm64 go vet ./...
	GOOS=windows go build -o /dev/null ./cmd/redfence && GOOS=windows go build ./client/ ./client/rest/ ./fencing/ ./service/ ./api/ ./store/
	go test -race -count=1 -timeout 20m $(TESTFLAGS) ./...
	$(MAKE) --no-print-directory test-ts

## chaos:     long fault-injection suite (chaos/, < 10 min) with the report; CHAOS_OUT=dir keeps it and any porcupine visualisation
chaos: deps
	go test -c -o bin/chaos.test ./chaos
	cd chaos && ../bin/chaos.test -test.count=1 -test.timeout 15m -long $(CHAOSFLAGS)

## test-ts:   TypeScript SDK (sdk/typescript): npm ci, build, node --test against a real redfence dev
test-ts: deps build
	@command -v node >/dev/null && command -v npm >/dev/null || { echo "test-ts needs Node.js >= 20.3 and npm" >&2; exit 1; }
	@node -e 'const [a, b] = process.versions.node.split(".").map(Number); process.exit(a > 20 || (a === 20 && b >= 3) ? 0 : 1)' || { echo "test-ts needs Node.js >= 20.3 (found $$(node --version))" >&2; exit 1; }
	cd sdk/typescript && npm ci --no-audit --no-fund && REDFENCE_BIN=$(CURDIR)/$(BIN) npm test

## bench:     Redfence vs redsync vs etcd side by side (bench/, ~11 min); rewrites README's table (extra flags via BENCHFLAGS=...)
bench: bench-deps build
	cd bench && go run -mod=mod . -redfence ../$(BIN) -readme ../README.md $(BENCHFLAGS)

## bench-micro: Go micro-benchmarks of the hot functions (quorum round, token issuance, request decode/encode), with -benchmem
bench-micro: deps
	go test -run '^$$' -bench . -benchmem ./service/ ./store/ ./api/

## bench-quick: a ~2-minute subset (1 and 64 workers, 1.2 s per cell); prints the table only
bench-quick: bench-deps build
	cd bench && go run -mod=mod . -redfence ../$(BIN) -duration 1200ms -warmup 500ms -workers 1,64 $(BENCHFLAGS)

bench-deps:
	@bash scripts/install-deps.sh --bench

## fmt-check: fail and list files if gofmt would change any
fmt-check:
	@files="$$(gofmt -l .)" || { echo "gofmt failed (syntax error?)" >&2; exit 1; }; \
	if [[ -n "$$files" ]]; then \
		echo "These files need gofmt (run: gofmt -w <file>):" >&2; \
		echo "$$files" >&2; \
		exit 1; \
	fi

## cover:     run the suite with coverage, write coverage.out and print the total
cover: deps
	go test -race -count=1 -timeout 20m -covermode=atomic -coverprofile=coverage.out $(TESTFLAGS) ./...
	go tool cover -func=coverage.out | tail -n 1

## clean:     remove build output
clean:
	rm -rf bin coverage.out
