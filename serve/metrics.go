package serve

import (
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the daemon's Prometheus series, on a registry of its own so
// that several daemons can live in one process (tests).
type metrics struct {
	reg        *prometheus.Registry
	tokens     prometheus.Counter
	forwards   prometheus.Counter
	fillRatio  prometheus.Histogram
	forwardSec prometheus.Histogram
	queueWait  prometheus.Histogram
	queueJobs  prometheus.Gauge
	queueTok   prometheus.Gauge
	latency    *prometheus.HistogramVec
	codes      *prometheus.CounterVec
	chunks     *prometheus.CounterVec

	// nTokens and nForwards mirror the counters for Status.
	nTokens, nForwards atomic.Int64

	// rate keeps (time, tokens) of recent forwards for Status's tokens/s.
	mu   sync.Mutex
	hist []ratePoint
}

type ratePoint struct {
	t time.Time
	n int
}

// rateWindow is the span Status's tokens/s is averaged over.
const rateWindow = time.Minute

func newMetrics() *metrics {
	m := &metrics{reg: prometheus.NewRegistry()}
	m.tokens = prometheus.NewCounter(prometheus.CounterOpts{Name: "teacherd_tokens_total", Help: "Token positions scored (rate() gives tokens/s)."})
	m.forwards = prometheus.NewCounter(prometheus.CounterOpts{Name: "teacherd_forwards_total", Help: "Forward passes run."})
	m.fillRatio = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "teacherd_batch_fill_ratio", Help: "Tokens of a forward pass over the token budget.",
		Buckets: []float64{0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1}})
	m.forwardSec = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "teacherd_forward_seconds", Help: "Duration of one forward pass.",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 16)})
	m.queueWait = prometheus.NewHistogram(prometheus.HistogramOpts{Name: "teacherd_queue_wait_seconds", Help: "Time work waited in the queue.",
		Buckets: prometheus.ExponentialBuckets(0.0005, 2, 16)})
	m.queueJobs = prometheus.NewGauge(prometheus.GaugeOpts{Name: "teacherd_queue_depth", Help: "Work items waiting for a forward pass."})
	m.queueTok = prometheus.NewGauge(prometheus.GaugeOpts{Name: "teacherd_queue_tokens", Help: "Tokens waiting for a forward pass."})
	m.latency = prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: "teacherd_request_seconds", Help: "RPC latency (Score: per sample).",
		Buckets: prometheus.ExponentialBuckets(0.001, 2, 18)}, []string{"method"})
	m.codes = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "teacherd_requests_total", Help: "Finished RPCs by method and gRPC code."}, []string{"method", "code"})
	m.chunks = prometheus.NewCounterVec(prometheus.CounterOpts{Name: "teacherd_fill_chunks_total", Help: "Fill chunks by outcome (committed, skipped: already done, busy: another writer was computing it, failed)."}, []string{"outcome"})
	m.reg.MustRegister(m.tokens, m.forwards, m.fillRatio, m.forwardSec, m.queueWait, m.queueJobs, m.queueTok, m.latency, m.codes, m.chunks,
		prometheus.NewGoCollector(), prometheus.NewProcessCollector(prometheus.ProcessCollectorOpts{}))
	return m
}

func (m *metrics) forward(tokens, budget, jobs int, d time.Duration) {
	m.tokens.Add(float64(tokens))
	m.nTokens.Add(int64(tokens))
	m.nForwards.Add(1)
	m.forwards.Inc()
	m.fillRatio.Observe(float64(tokens) / float64(budget))
	m.forwardSec.Observe(d.Seconds())
	now := time.Now()
	m.mu.Lock()
	m.hist = append(m.hist, ratePoint{now, tokens})
	i := 0
	for i < len(m.hist) && now.Sub(m.hist[i].t) > rateWindow {
		i++
	}
	m.hist = append(m.hist[:0], m.hist[i:]...)
	m.mu.Unlock()
}

func (m *metrics) queued(jobs, tokens int) {
	m.queueJobs.Set(float64(jobs))
	m.queueTok.Set(float64(tokens))
}

func (m *metrics) waited(d time.Duration) { m.queueWait.Observe(d.Seconds()) }

// rate returns tokens/s over the last rateWindow (or since the first
// forward in it).
func (m *metrics) rate() float64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	if len(m.hist) == 0 {
		return 0
	}
	n := 0
	for _, p := range m.hist {
		n += p.n
	}
	span := time.Since(m.hist[0].t)
	if span < time.Second {
		span = time.Second
	}
	return float64(n) / span.Seconds()
}
