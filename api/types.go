package api

import "encoding/json"

// AcquireRequest is the body of POST /v1/locks/{name}. Every field is optional.
type AcquireRequest struct {
	// TTLMS is the lease length in milliseconds; the server default when absent.
	TTLMS *int64 `json:"ttl_ms,omitempty"`
	// WaitMS is how long to keep trying while the lock is held; 0 (the
	// default) tries once.
	WaitMS *int64 `json:"wait_ms,omitempty"`
	// Owner is a label for humans (not a secret, shown by GET), at most 256
	// printable characters.
	Owner *string `json:"owner,omitempty"`
}

// ExtendRequest is the body of POST /v1/locks/{name}/extend.
type ExtendRequest struct {
	// TTLMS is the new lease length from now; the server default when absent.
	TTLMS *int64 `json:"ttl_ms,omitempty"`
}

// LockResponse describes a grant (201 from acquire, 200 from extend).
type LockResponse struct {
	Name string `json:"name"`
	// LockToken is the holder's secret; returned by acquire only.
	LockToken    string `json:"lock_token,omitempty"`
	FencingToken int64  `json:"fencing_token"`
	TTLMS        int64  `json:"ttl_ms"`
	// ValidityMS is how long the lease lasts from the client's send time (the
	// server counts it from the request's arrival, which comes after).
	ValidityMS int64  `json:"validity_ms"`
	ExpiresAt  string `json:"expires_at"`
	Owner      string `json:"owner"`
}

// LockStatus is the body of GET /v1/locks/{name}; it never holds the lock token.
type LockStatus struct {
	Name             string `json:"name"`
	Held             bool   `json:"held"`
	RemainingMS      int64  `json:"remaining_ms"`
	Owner            string `json:"owner,omitempty"`
	LastFencingToken int64  `json:"last_fencing_token"`
}

// PutResourceRequest is the body of PUT /v1/resources/{name}.
type PutResourceRequest struct {
	FencingToken *int64          `json:"fencing_token"`
	Data         json.RawMessage `json:"data"`
}

// Resource is a document of the reference store.
type Resource struct {
	Name         string          `json:"name"`
	Data         json.RawMessage `json:"data"`
	FencingToken int64           `json:"fencing_token"`
	Version      int64           `json:"version"`
	UpdatedAt    string          `json:"updated_at"`
}

// Node is one Redis node's health in GET /v1/nodes.
type Node struct {
	Address   string  `json:"address"`
	Up        bool    `json:"up"`
	LatencyMS float64 `json:"latency_ms"`
	Error     string  `json:"error,omitempty"`
	// QuarantinedUntil is set while the node's votes do not count because it
	// restarted without its data (RFC 3339).
	QuarantinedUntil string `json:"quarantined_until,omitempty"`
	// QuarantineReason says why, with QuarantinedUntil: lost_memory,
	// evicting, evicted or policy_unknown (service.Quarantine*).
	QuarantineReason string `json:"quarantine_reason,omitempty"`
}

// NodeList is the body of GET /v1/nodes.
type NodeList struct {
	Quorum int    `json:"quorum"`
	Up     int    `json:"up"`
	Nodes  []Node `json:"nodes"`
}

// Health is the body of /healthz and /readyz.
type Health struct {
	// Status is ok (healthz), ready, unavailable or shutting-down (readyz).
	Status   string          `json:"status"`
	Redis    *RedisHealth    `json:"redis,omitempty"`
	Postgres *PostgresHealth `json:"postgres,omitempty"`
}

// RedisHealth summarises the nodes for /readyz.
type RedisHealth struct {
	// Up counts nodes that answer and whose votes count (not quarantined).
	Up          int `json:"up"`
	Quarantined int `json:"quarantined"`
	Total       int `json:"total"`
	Quorum      int `json:"quorum"`
}

// PostgresHealth summarises Postgres for /readyz.
type PostgresHealth struct {
	Up    bool   `json:"up"`
	Error string `json:"error,omitempty"`
}

// required implements requiredFields: the fencing token has no default.
func (*PutResourceRequest) required(field string) (string, bool) {
	if field == "fencing_token" {
		return "a positive integer", true
	}
	return "", false
}
