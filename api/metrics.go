package api

import (
	"context"
	"errors"
	"log/slog"
	"net/http"
	"sort"
	"strconv"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/redfence/redfence/fencing"
	"github.com/redfence/redfence/service"
)

// Metric names. They are part of the operator's contract (the Grafana
// dashboard under deploy/grafana uses them): rename none.
const (
	MetricHTTPRequests       = "redfence_http_requests_total"
	MetricHTTPSeconds        = "redfence_http_request_duration_seconds"
	MetricAcquisitions       = "redfence_acquisitions_total"
	MetricAcquireSeconds     = "redfence_acquire_duration_seconds"
	MetricExtensions         = "redfence_extensions_total"
	MetricReleases           = "redfence_releases_total"
	MetricReleaseSeconds     = "redfence_release_duration_seconds"
	MetricStaleWrites        = "redfence_stale_writes_refused_total"
	MetricQuorumFailures     = "redfence_quorum_failures_total"
	MetricNodeRequests       = "redfence_node_requests_total"
	MetricNodeSeconds        = "redfence_node_request_duration_seconds"
	MetricNodeQuarantined    = "redfence_node_quarantined"
	MetricNodeQuarantines    = "redfence_node_quarantines_total"
	MetricBlockedWaiters     = "redfence_blocked_waiters"
	MetricTokensIssued       = "redfence_tokens_issued_total"
	MetricTokenIssueFailures = "redfence_token_issue_failures_total"
	MetricTokenIssueSeconds  = "redfence_token_issue_duration_seconds"
	MetricSpeculations       = "redfence_token_speculations_total"
)

// latencyBuckets spans sub-millisecond Redis answers to minute-long waits.
var latencyBuckets = []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}

// register registers c on reg, or returns the collector of the same
// description already there (a registry shared by several Handlers or
// Observers), so every instance feeds the one that is scraped.
func register[C prometheus.Collector](reg prometheus.Registerer, c C) C {
	if err := reg.Register(c); err != nil {
		var are prometheus.AlreadyRegisteredError
		if errors.As(err, &are) {
			if existing, ok := are.ExistingCollector.(C); ok {
				return existing
			}
		}
		panic(err)
	}
	return c
}

// metrics are the API's Prometheus collectors, on the injected registry.
type metrics struct {
	requests       *prometheus.CounterVec
	requestSeconds *prometheus.HistogramVec
	acquisitions   *prometheus.CounterVec
	acquireSeconds prometheus.Histogram
	extensions     *prometheus.CounterVec
	releases       *prometheus.CounterVec
	releaseSeconds prometheus.Histogram
	staleWrites    prometheus.Counter
	quorumFailures *prometheus.CounterVec

	// The series of the label values seen so far, resolved once: a lookup
	// in a map that is replaced, never changed, on a new label value.
	http           seriesCache[httpKey, httpSeries]
	acquireByOut   seriesCache[string, prometheus.Counter]
	extendByOut    seriesCache[string, prometheus.Counter]
	releaseByOut   seriesCache[string, prometheus.Counter]
	quorumFailedOp map[string]prometheus.Counter // made up front, never changed
}

// httpKey is the labels of one request's HTTP series.
type httpKey struct {
	route, method string
	code          int
}

type httpSeries struct {
	requests prometheus.Counter
	seconds  prometheus.Observer
}

// seriesCache maps label values to their series, resolving each once. Reads
// take no lock: the map is copied on write, which happens once per label
// value. Callers bound the label values (see request).
type seriesCache[K comparable, V any] struct {
	mu sync.Mutex
	m  atomic.Pointer[map[K]V]
}

func (c *seriesCache[K, V]) load(k K) (V, bool) {
	if m := c.m.Load(); m != nil {
		v, ok := (*m)[k]
		return v, ok
	}
	var zero V
	return zero, false
}

// store caches v under k, unless another series got there first: it
// returns the one cached.
func (c *seriesCache[K, V]) store(k K, v V) V {
	c.mu.Lock()
	defer c.mu.Unlock()
	old := c.m.Load()
	if old != nil {
		if v, ok := (*old)[k]; ok {
			return v
		}
	}
	m := make(map[K]V, lenOf(old)+1)
	if old != nil {
		for k, v := range *old {
			m[k] = v
		}
	}
	m[k] = v
	c.m.Store(&m)
	return v
}

// counter returns vec's counter for label, through c.
func counter(c *seriesCache[string, prometheus.Counter], vec *prometheus.CounterVec, label string) prometheus.Counter {
	if v, ok := c.load(label); ok {
		return v
	}
	return c.store(label, vec.WithLabelValues(label))
}

func newMetrics(reg *prometheus.Registry) *metrics {
	m := &metrics{
		requests: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricHTTPRequests, Help: "HTTP requests by route, method and status code.",
		}, []string{"route", "method", "code"})),
		requestSeconds: register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: MetricHTTPSeconds, Help: "HTTP request latency by route and method.", Buckets: latencyBuckets,
		}, []string{"route", "method"})),
		acquisitions: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricAcquisitions, Help: "Lock acquisitions by outcome (granted or the problem type).",
		}, []string{"outcome"})),
		acquireSeconds: register(reg, prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: MetricAcquireSeconds, Help: "Latency of granted acquisitions, including waiting.", Buckets: latencyBuckets,
		})),
		extensions: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricExtensions, Help: "Lease extensions by outcome (extended or the problem type, e.g. lock-lost).",
		}, []string{"outcome"})),
		releases: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricReleases, Help: "Lock releases by outcome (released or the problem type, e.g. not-holder).",
		}, []string{"outcome"})),
		releaseSeconds: register(reg, prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: MetricReleaseSeconds, Help: "Latency of successful releases.", Buckets: latencyBuckets,
		})),
		staleWrites: register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricStaleWrites, Help: "Reference-store writes refused for a stale or unissued fencing token.",
		})),
		quorumFailures: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricQuorumFailures, Help: "Lock operations that failed because too few Redis nodes answered, by operation.",
		}, []string{"op"})),
	}
	// Every operation shows up at 0, so rates and alerts work before the
	// first failure.
	m.quorumFailedOp = make(map[string]prometheus.Counter)
	for _, op := range []string{"acquire", "extend", "release", "status"} {
		m.quorumFailedOp[op] = m.quorumFailures.WithLabelValues(op)
	}
	register(reg, collectors.NewGoCollector())
	register(reg, collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// methodOther is the method label of requests whose method is not one of
// HTTP's standard ones: a client can send any token as a method, and each
// would otherwise become a new series, unbounded and without a key.
const methodOther = "other"

// methodLabel is the method label of method: itself when standard, else
// methodOther.
func methodLabel(method string) string {
	switch method {
	case http.MethodGet, http.MethodHead, http.MethodPost, http.MethodPut, http.MethodPatch, http.MethodDelete,
		http.MethodConnect, http.MethodOptions, http.MethodTrace:
		return method
	}
	return methodOther
}

// request counts and times one request.
func (m *metrics) request(route, method string, code int, d time.Duration) {
	k := httpKey{route, methodLabel(method), code}
	s, ok := m.http.load(k)
	if !ok {
		s = m.resolveHTTP(k)
		if code >= 100 && code <= 999 {
			m.http.store(k, s)
		}
	}
	s.requests.Inc()
	s.seconds.Observe(d.Seconds())
}

func (m *metrics) resolveHTTP(k httpKey) httpSeries {
	return httpSeries{
		requests: m.requests.WithLabelValues(k.route, k.method, strconv.Itoa(k.code)),
		seconds:  m.requestSeconds.WithLabelValues(k.route, k.method),
	}
}

func (m *metrics) acquire(outcome string) {
	counter(&m.acquireByOut, m.acquisitions, outcome).Inc()
	if outcome == kQuorum.slug {
		m.quorumFailed("acquire")
	}
}

// extended counts a lease extension with its outcome.
func (m *metrics) extended(outcome string) {
	counter(&m.extendByOut, m.extensions, outcome).Inc()
}

// released counts a release with its outcome.
func (m *metrics) released(outcome string) {
	counter(&m.releaseByOut, m.releases, outcome).Inc()
}

func (m *metrics) quorumFailed(op string) {
	if c, ok := m.quorumFailedOp[op]; ok {
		c.Inc()
		return
	}
	m.quorumFailures.WithLabelValues(op).Inc()
}

// failed counts a failed lock operation (extend, release or status).
func (m *metrics) failed(op string, err error) {
	k := classify(err)
	switch op {
	case "extend":
		m.extended(k.slug)
	case "release":
		m.released(k.slug)
	}
	if k == kQuorum {
		m.quorumFailed(op)
	}
}

// classifyOutcome labels a failed acquisition by its problem type.
func classifyOutcome(err error) string { return classify(err).slug }

// Observer turns a Locker's measurements (service.Observer) and fencing-token
// issuance into Prometheus metrics: per-node request counts by outcome and
// latency, node quarantine state, blocked waiters, and tokens issued. Create
// one per registry with NewObserver and pass it as service.Options.Observer;
// wrap the Locker's issuer with Issuer. It is safe for concurrent use.
type Observer struct {
	nodeRequests *prometheus.CounterVec
	nodeSeconds  *prometheus.HistogramVec
	waiters      prometheus.Gauge
	issued       prometheus.Counter
	issueFailed  prometheus.Counter
	issueSeconds prometheus.Histogram
	speculations *prometheus.CounterVec
	nodes        *nodeState
	// series caches, per node, operation and outcome, the series NodeOp
	// feeds: resolving label values takes a hash and a lock per call.
	series sync.Map // nodeOpKey -> *nodeOpSeries
}

type nodeOpKey struct {
	addr, op string
	outcome  service.Outcome
}

type nodeOpSeries struct {
	requests prometheus.Counter
	seconds  prometheus.Observer
}

var _ service.Observer = (*Observer)(nil)

// NewObserver registers the Locker's metrics on reg and returns the Observer
// that feeds them. Calling it again with the same registry is allowed; both
// Observers then feed the same metrics.
func NewObserver(reg prometheus.Registerer) *Observer {
	o := &Observer{
		nodeRequests: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricNodeRequests,
			Help: "Requests to each Redis node by operation (acquire, extend, release, ttl, ping, sweep: a delete whose outcome was unknown, sent again) and outcome (yes, no, error, timeout, ...).",
		}, []string{"node", "op", "outcome"})),
		nodeSeconds: register(reg, prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: MetricNodeSeconds, Help: "Latency of requests to each Redis node, by operation.", Buckets: latencyBuckets,
		}, []string{"node", "op"})),
		waiters: register(reg, prometheus.NewGauge(prometheus.GaugeOpts{
			Name: MetricBlockedWaiters, Help: "Blocking acquires currently waiting between attempts for a held lock.",
		})),
		issued: register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricTokensIssued,
			Help: "Fencing tokens issued. Above granted acquisitions when grants fail after issuance, or speculative tokens stay unused (burned tokens).",
		})),
		issueFailed: register(reg, prometheus.NewCounter(prometheus.CounterOpts{
			Name: MetricTokenIssueFailures, Help: "Fencing-token issuances that failed (Postgres unavailable or too slow).",
		})),
		issueSeconds: register(reg, prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: MetricTokenIssueSeconds, Help: "Latency of fencing-token issuance in Postgres.", Buckets: latencyBuckets,
		})),
		speculations: register(reg, prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: MetricSpeculations,
			Help: "Speculative fencing-token issuances (sent with the Redis round by a try running alone), by outcome: " +
				"confirmed (granted), superseded (not grantable: issued anew after the quorum), abandoned (the try failed: its token, if issued, stays unused), " +
				"failed (Postgres error, or no idle pooled connection to speculate on).",
		}, []string{"outcome"})),
		nodes: register(reg, &nodeState{now: time.Now, until: make(map[string]time.Time), starts: make(map[string]uint64)}),
	}
	return o
}

// NodeOp implements service.Observer.
func (o *Observer) NodeOp(addr, op string, outcome service.Outcome, d time.Duration) {
	k := nodeOpKey{addr, op, outcome}
	v, ok := o.series.Load(k)
	if !ok {
		o.nodes.seen(addr)
		v, _ = o.series.LoadOrStore(k, &nodeOpSeries{
			requests: o.nodeRequests.WithLabelValues(addr, op, outcome.String()),
			seconds:  o.nodeSeconds.WithLabelValues(addr, op),
		})
	}
	ser := v.(*nodeOpSeries)
	ser.requests.Inc()
	ser.seconds.Observe(d.Seconds())
}

// Waiting implements service.Observer.
func (o *Observer) Waiting(delta int) { o.waiters.Add(float64(delta)) }

// Quarantine implements service.Observer.
func (o *Observer) Quarantine(addr string, until time.Time) { o.nodes.quarantine(addr, until) }

// Issuer returns iss with issuance counted and timed. If iss is a
// fencing.Speculator, so is the Issuer returned, its speculations counted
// too.
func (o *Observer) Issuer(iss service.Issuer) service.Issuer {
	c := &countingIssuer{Issuer: iss, o: o}
	if s, ok := iss.(fencing.Speculator); ok {
		return &countingSpeculator{countingIssuer: c, spec: s}
	}
	return c
}

type countingSpeculator struct {
	*countingIssuer
	spec fencing.Speculator
}

var _ fencing.Speculator = (*countingSpeculator)(nil)

func (c *countingSpeculator) Speculate(ctx context.Context, claim fencing.Claim, last fencing.Token) (fencing.Speculation, error) {
	start := time.Now()
	s, err := c.spec.Speculate(ctx, claim, last)
	if err != nil {
		c.o.speculations.WithLabelValues("failed").Inc()
		return nil, err
	}
	return &countingSpeculation{Speculation: s, o: c.o, start: start}, nil
}

// countingSpeculation counts a speculation's outcome; a confirmed one is
// also counted and timed as an issuance (from its start).
type countingSpeculation struct {
	fencing.Speculation
	o     *Observer
	start time.Time
}

// issuedSpeculation is a fencing.Speculation that tells, once it ended,
// which token its statement issued (0: none, or not known), as store.DB's
// does.
type issuedSpeculation interface {
	Issued() fencing.Token
}

// countBurned counts the token of an ended speculation that was not
// granted, if it issued one: never withdrawn, it is a burned token, which
// redfence_tokens_issued_total counts above the grants.
func (s *countingSpeculation) countBurned() {
	if is, ok := s.Speculation.(issuedSpeculation); ok && is.Issued() != 0 {
		s.o.issued.Inc()
	}
}

func (s *countingSpeculation) Confirm(ctx context.Context) (fencing.Token, error) {
	t, err := s.Speculation.Confirm(ctx)
	switch {
	case err == nil:
		s.o.speculations.WithLabelValues("confirmed").Inc()
		s.o.issueSeconds.Observe(time.Since(s.start).Seconds())
		s.o.issued.Inc()
	case errors.Is(err, fencing.ErrNotConfirmed):
		s.o.speculations.WithLabelValues("superseded").Inc()
		s.countBurned()
	default:
		s.o.speculations.WithLabelValues("failed").Inc()
		s.countBurned()
	}
	return t, err
}

func (s *countingSpeculation) Abandon(ctx context.Context) error {
	err := s.Speculation.Abandon(ctx)
	if err != nil {
		s.o.speculations.WithLabelValues("failed").Inc()
	} else {
		s.o.speculations.WithLabelValues("abandoned").Inc()
	}
	s.countBurned()
	return err
}

type countingIssuer struct {
	service.Issuer
	o *Observer
}

func (c *countingIssuer) Issue(ctx context.Context, claim fencing.Claim) (fencing.Token, error) {
	start := time.Now()
	t, err := c.Issuer.Issue(ctx, claim)
	c.o.issueSeconds.Observe(time.Since(start).Seconds())
	if err != nil {
		c.o.issueFailed.Inc()
		return t, err
	}
	c.o.issued.Inc()
	return t, nil
}

// nodeState reports each node's quarantine state at scrape time, so a
// quarantine that simply runs out shows as over without another event.
type nodeState struct {
	now    func() time.Time
	mu     sync.Mutex
	until  map[string]time.Time // every node seen; zero: not quarantined
	starts map[string]uint64    // quarantines begun, per node
}

var (
	quarantinedDesc = prometheus.NewDesc(MetricNodeQuarantined,
		"1 while a Redis node's votes are not counted: it lost its memory (restart quarantine) or may evict keys (maxmemory-policy), else 0.", []string{"node"}, nil)
	quarantinesDesc = prometheus.NewDesc(MetricNodeQuarantines,
		"Quarantines begun, per Redis node: it lost its memory (a restart without its data) or may evict keys (maxmemory-policy).", []string{"node"}, nil)
)

func (s *nodeState) seen(addr string) {
	s.mu.Lock()
	if _, ok := s.until[addr]; !ok {
		s.until[addr] = time.Time{}
	}
	s.mu.Unlock()
}

func (s *nodeState) quarantine(addr string, until time.Time) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !until.IsZero() && !s.until[addr].After(s.now()) {
		s.starts[addr]++
	}
	s.until[addr] = until
}

func (s *nodeState) Describe(ch chan<- *prometheus.Desc) {
	ch <- quarantinedDesc
	ch <- quarantinesDesc
}

func (s *nodeState) Collect(ch chan<- prometheus.Metric) {
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.now()
	addrs := make([]string, 0, len(s.until))
	for a := range s.until {
		addrs = append(addrs, a)
	}
	sort.Strings(addrs)
	for _, a := range addrs {
		v := 0.0
		if s.until[a].After(now) {
			v = 1
		}
		ch <- prometheus.MustNewConstMetric(quarantinedDesc, prometheus.GaugeValue, v, a)
		ch <- prometheus.MustNewConstMetric(quarantinesDesc, prometheus.CounterValue, float64(s.starts[a]), a)
	}
}

// lastIssued is the part of a Store that tells which grant a lock token
// belongs to (*store.DB has it). Audit lines use it to name the owner and
// fencing token of a release (or a refused extension) of a grant this
// Handler does not remember (grantCache: made by another server, or before
// a restart); without it they name the lock only.
type lastIssued interface {
	Last(ctx context.Context, key string) (fencing.Record, error)
}

// grantOf returns the owner and fencing token of the grant that lockToken
// received for key, if that grant is still the newest one issued; ok is
// false otherwise (a newer grant exists, or the store cannot tell).
func (h *Handler) grantOf(ctx context.Context, key, lockToken string) (owner string, token fencing.Token, ok bool) {
	li, isLI := h.store.(lastIssued)
	if !isLI {
		return "", 0, false
	}
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), time.Second)
	defer cancel()
	rec, err := li.Last(ctx, key)
	if err != nil || rec.Token == 0 || rec.Holder != service.HolderID(lockToken) {
		return "", 0, false
	}
	return rec.Owner, rec.Token, true
}

// maxGrantLookups bounds the grant lookups in Postgres under way at once:
// releases come faster than Postgres answers (it stalls, or a client sends
// refused releases back to back), and the lookups share the pool that
// issues tokens. Past it, the audit line names no owner or token.
const maxGrantLookups = 64

// lookupGrant starts looking up, in the background, the owner and fencing
// token of the grant lockToken received for key (see grantOf), when audit
// lines at level are logged at all and fewer than maxGrantLookups are under
// way (nil otherwise).
func (h *Handler) lookupGrant(r *http.Request, level slog.Level, key, lockToken string) *grantLookup {
	if !h.log.Enabled(r.Context(), level) {
		return nil
	}
	select {
	case h.lookups <- struct{}{}:
	default:
		return nil
	}
	l := &grantLookup{done: make(chan struct{})}
	go func() {
		defer func() { <-h.lookups }()
		defer close(l.done)
		l.owner, l.token, _ = h.grantOf(r.Context(), key, lockToken)
	}()
	return l
}

// grantLookup is a lookup of a grant's owner and fencing token in progress.
type grantLookup struct {
	done  chan struct{} // closed when owner and token are set
	owner string
	token fencing.Token
}

// noTTL leaves ttl_ms out of an audit line.
const noTTL = -1

// audit logs one audit record: a grant, extension, release or refusal, with
// the lock's name, the owner label, the fencing token (when known), the
// outcome ("granted", "extended", "released" or the problem type) and, for
// grants and extensions, ttl_ms (unless noTTL). It never logs the lock
// token, nor an API key or r's own lock token in the name or owner (see
// redact).
func (h *Handler) audit(r *http.Request, level slog.Level, msg, name, owner string, token fencing.Token, outcome string, ttlMS int64) {
	ctx := r.Context()
	if !h.raw.Enabled(ctx, level) {
		return
	}
	var buf [7]slog.Attr
	attrs := append(buf[:0], slog.Bool("audit", true), slog.String("request_id", requestID(ctx)),
		slog.String("name", redact(r, name)), slog.String("owner", redact(r, owner)))
	if token.Valid() {
		attrs = append(attrs, slog.Int64("fencing_token", int64(token)))
	}
	attrs = append(attrs, slog.String("outcome", outcome))
	if ttlMS != noTTL {
		attrs = append(attrs, slog.Int64("ttl_ms", ttlMS))
	}
	h.logRecord(ctx, time.Now(), PrincipalFrom(ctx), level, msg, attrs...)
}
