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
// each sending one sample and waiting for its answer; it returns the
// per-sample latencies, the tokens scored and the ResourceExhausted count,
// and fails on any other error.
func loadRound(t testing.TB, addr string, streams int, dur time.Duration) ([]time.Duration, int64, int64) {
	cl, conn := dialTeacher(t, addr, "")
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), dur)
	defer cancel()
	var (
		mu       sync.Mutex
		lats     []time.Duration
		tokens   int64
		rejected int64
		wg       sync.WaitGroup
		failures []error
	)
	for s := 0; s < streams; s++ {
		wg.Add(1)
		go func(seed int64) {
			defer wg.Done()
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
					// ended the stream (its copy of the round's deadline can
					// fire before ctx's): Recv gives the status that ended it.
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
				}
				st.CloseSend()
			}
		}(int64(s))
	}
	wg.Wait()
	for _, err := range failures {
		t.Errorf("unexpected error under load: %v", err)
	}
	return lats, tokens, rejected
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
	loadRound(t, d.Addr(), 32, 1500*time.Millisecond) // warm up: connections, pools
	runtime.GC()
	var m0, m1 runtime.MemStats
	runtime.ReadMemStats(&m0)
	g0 := runtime.NumGoroutine()
	lats, tokens, rejected := loadRound(t, d.Addr(), 32, 1500*time.Millisecond)
	// Stream goroutines of both sides wind down asynchronously; allow
	// them up to 2 s (a leak stays).
	for i := 0; i < 40 && runtime.NumGoroutine() > g0+10; i++ {
		time.Sleep(50 * time.Millisecond)
	}
	runtime.GC()
	runtime.ReadMemStats(&m1)
	g1 := runtime.NumGoroutine()
	t.Logf("under load (2 shared cores): %d samples, %.0f tokens/s, latency p50 %v p99 %v, %d ResourceExhausted",
		len(lats), float64(tokens)/1.5, pct(lats, 0.5), pct(lats, 0.99), rejected)
	if len(lats) == 0 {
		t.Fatal("no sample was scored")
	}
	if g1 > g0+10 {
		t.Errorf("goroutines grew from %d to %d across rounds", g0, g1)
	}
	if m1.HeapAlloc > m0.HeapAlloc+32<<20 {
		t.Errorf("heap grew from %d to %d bytes across rounds", m0.HeapAlloc, m1.HeapAlloc)
	}
}
