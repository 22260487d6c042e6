# syntax=docker/dockerfile:1
# Redfence container image: static Go binary on distroless (non-root).
#   docker build --build-arg VERSION=$(git describe --tags --always --dirty) -t redfence .

# ---- build stage ------------------------------------------------------------
FROM golang:1.26-bookworm AS build
WORKDIR /src

# Module downloads get their own layer: only re-run when go.mod/go.sum change.
COPY go.mod go.sum ./
RUN go mod download

COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath \
      -ldflags "-s -w -X main.version=${VERSION}" \
      -o /out/redfence ./cmd/redfence

# ---- runtime stage ------------------------------------------------------------
FROM gcr.io/distroless/static-debian12:nonroot
COPY --from=build /out/redfence /redfence
USER nonroot:nonroot
EXPOSE 8080
# No curl in distroless: the binary GETs http://127.0.0.1:8080/healthz itself.
HEALTHCHECK --interval=10s --timeout=3s --start-period=10s --retries=3 \
  CMD ["/redfence", "healthcheck"]
ENTRYPOINT ["/redfence"]
CMD ["serve"]
