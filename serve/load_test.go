package serve

import (
	"context"
	"io"
	"math/rand"
	"runtime"
	"sort"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "distill/proto/distill/v1"
	"google.golang.org/protobuf/proto"
)

// loadRound runs streams concurrent Score streams against addr for dur,
// and on until every stream has had a sample scored (a slow machine
// lengthens the round rather than leaving streams idle), each sending one
// sample and waiting for its answer; it returns the per-sample latencies,
// the tokens scored, the ResourceExhausted count and the round's length,
// and fails on any other error.
func loadRound(t testing.TB, addr string, streams int, dur time.Duration) ([]time.Duration, int64, int64, time.Duration) {
	cl, conn := dialTeacher(t, addr, "")
	defer conn.Close()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	var (
		mu       sync.Mutex
		lats     []time.Duration
		tokens   int64
		rejected int64
		wg       sync.WaitGroup
		scored   sync.WaitGroup // each stream: its first sample, or its end
		failures []error
	)
	t0 := time.Now()
	scored.Add(streams)
	for s := 0; s < streams; s++ {
		wg.Add(1)
		go func(seed int64) {
			defer wg.Done()
			var first sync.Once
			defer first.Do(scored.Done)
			r := rand.New(rand.NewSource(seed))
			for ctx.Err() == nil {
				st, err := cl.Score(ctx)
				if err != nil {
					break
				}
				for ctx.Err() == nil {
					toks := make([]int32, 8+r.Intn(56))
					for i := range toks {
						toks[i] = int32(r.Intn(512))
					}
					t0 := time.Now()
					// Send fails with io.EOF when the server has already
					// ended the stream: Recv gives the status that ended it.
					if err = st.Send(&pb.ScoreRequest{Tokens: toks, K: proto.Int32(8)}); err == nil || err == io.EOF {
						_, err = st.Recv()
					}
					if err != nil {
						mu.Lock()
						switch status.Code(err) {
						case codes.ResourceExhausted:
							rejected++ // intended backpressure: back off, new stream
						case codes.Canceled, codes.DeadlineExceeded:
						default:
							if ctx.Err() == nil {
								failures = append(failures, err)
							}
						}
						mu.Unlock()
						time.Sleep(5 * time.Millisecond)
						break
					}
					mu.Lock()
					lats = append(lats, time.Since(t0))
					tokens += int64(len(toks))
					mu.Unlock()
					first.Do(scored.Done)
				}
				st.CloseSend()
			}
		}(int64(s))
	}
	<-time.After(dur) // the round's length, a measurement: no outcome depends on it
	allScored := make(chan struct{})
	go func() { scored.Wait(); close(allScored) }()
	select {
	case <-allScored:
	case <-time.After(time.Minute): // watchdog: only a hang gets here
		t.Errorf("a minute after the round's end, some of the %d streams still had no sample scored", streams)
	}
	cancel()
	wg.Wait()
	elapsed := time.Since(t0)
	for _, err := range failures {
		t.Errorf("unexpected error under load: %v", err)
	}
	return lats, tokens, rejected, elapsed
}

// settle waits until at most limit goroutines are left and returns their
// number. The stream goroutines of both sides of the loopback connection
// end asynchronously after a round, later on a slow machine; a leak stays
// whatever the wait, so the wait is only a watchdog (a minute) and a
// healthy run returns as soon as they are gone.
func settle(limit int) int {
	deadline := time.Now().Add(time.Minute)
	for {
		n := runtime.NumGoroutine()
		if n <= limit || time.Now().After(deadline) {
			return n
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func pct(l []time.Duration, p float64) time.Duration {
	if len(l) == 0 {
		return 0
	}
	sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
	return l[min(len(l)-1, int(p*float64(len(l))))]
}

// TestLoadScoreStreams is a bounded load test on loopback: 32 concurrent
// Score streams for 1.5 s against a daemon with a small queue, twice. Only
// ResourceExhausted (backpressure) may fail; goroutines and heap must not
// grow from the first round to the second.
func TestLoadScoreStreams(t *testing.T) {
	mdir := tinyModel(t)
	d := startDaemon(t, Config{Model: mdir, TokenBudget: 1024, QueueSamples: 24})
	idle := runtime.NumGoroutine()
	loadRound(t, d.Addr(), 32, 1500*time.Millisecond) // warm up: connections, pools
	g0 := settle(idle + 10)
	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	lats, tokens, rejected, took := loadRound(t, d.Addr(), 32, 1500*time.Millisecond)
	g1 := settle(g0 + 10)
	runtime.GC()
	runtime.ReadMemStats(&m1)
	t.Logf("under load: %d samples, %.0f tokens/s, latency p50 %v p99 %v, %d ResourceExhausted; goroutines %d idle, %d and %d after the rounds",
		len(lats), float64(tokens)/took.Seconds(), pct(lats, 0.5), pct(lats, 0.99), rejected, idle, g0, g1)
	if len(lats) == 0 {
		t.Fatal("no sample was scored")
	}
	if g1 > g0+10 {
		t.Errorf("goroutines grew from %d to %d across rounds (a minute after the round)", g0, g1)
	}
	if m1.HeapAlloc > m0.HeapAlloc+32<<20 {
		t.Errorf("heap grew from %d to %d bytes across rounds", m0.HeapAlloc, m1.HeapAlloc)
	}
}
