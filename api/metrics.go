package api

import (
	"errors"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
)

// metrics are the API's Prometheus collectors, on the injected registry.
type metrics struct {
	requests       *prometheus.CounterVec
	requestSeconds *prometheus.HistogramVec
	acquisitions   *prometheus.CounterVec
	acquireSeconds prometheus.Histogram
	releaseSeconds prometheus.Histogram
	staleWrites    prometheus.Counter
}

func newMetrics(reg *prometheus.Registry) *metrics {
	buckets := []float64{.0005, .001, .0025, .005, .01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60}
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redfence_http_requests_total", Help: "HTTP requests by route, method and status code.",
		}, []string{"route", "method", "code"}),
		requestSeconds: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "redfence_http_request_duration_seconds", Help: "HTTP request latency by route and method.", Buckets: buckets,
		}, []string{"route", "method"}),
		acquisitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "redfence_acquisitions_total", Help: "Lock acquisitions by outcome (granted or the problem type).",
		}, []string{"outcome"}),
		acquireSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "redfence_acquire_duration_seconds", Help: "Latency of granted acquisitions, including waiting.", Buckets: buckets,
		}),
		releaseSeconds: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "redfence_release_duration_seconds", Help: "Latency of successful releases.", Buckets: buckets,
		}),
		staleWrites: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "redfence_stale_writes_refused_total", Help: "Reference-store writes refused for a stale or unissued fencing token.",
		}),
	}
	for _, c := range []prometheus.Collector{m.requests, m.requestSeconds, m.acquisitions, m.acquireSeconds, m.releaseSeconds, m.staleWrites,
		collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{})} {
		// A registry shared with another Handler already has them.
		var are prometheus.AlreadyRegisteredError
		if err := reg.Register(c); err != nil && !errors.As(err, &are) {
			panic(err)
		}
	}
	return m
}

func (m *metrics) acquire(outcome string) { m.acquisitions.WithLabelValues(outcome).Inc() }

// classifyOutcome labels a failed acquisition by its problem type.
func classifyOutcome(err error) string { return classify(err).slug }
