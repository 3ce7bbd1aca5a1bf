package serve

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "distill/proto/distill/v1"
)

// TestFillSaysRetriesAsTheyHappen: a teacher that goes down in the middle
// of a fill is said to have failed, and to be retried, when it happens
// (not only in the summary's retry count), and said to answer again when
// it does; a teacher failing past --retry-for is said to be given up on.
func TestFillSaysRetriesAsTheyHappen(t *testing.T) {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	down := status.Error(codes.Unavailable, "connection refused")
	a := newFake("a:7070", "/a", nil)
	a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
		if call == 2 || call == 3 {
			return down
		}
		return nil
	}
	var out strings.Builder
	p := FillPlan{Dataset: ds, ChunkSamples: 8, PerWorker: 1, LogEvery: time.Hour, Out: &out}
	if _, err := RunFill(context.Background(), []Worker{a}, p); err != nil {
		t.Fatalf("fill: %v\n%s", err, out.String())
	}
	got := out.String()
	failed := strings.Index(got, "fill: teacher a:7070 failed (Unavailable: connection refused): its chunks go back to the queue; retrying it for up to 2m0s (--retry-for)\n")
	back := strings.Index(got, "fill: teacher a:7070 answers again (it failed for ")
	summary := strings.Index(got, "2 retries")
	if failed < 0 || back < failed || summary < back || strings.Count(got, "failed (Unavailable") != 1 {
		t.Errorf("output:\n%s", got)
	}
}

// syncWriter is a strings.Builder that several goroutines write.
type syncWriter struct {
	mu sync.Mutex
	b  strings.Builder
}

func (w *syncWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(p)
}

func (w *syncWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestFillSaysAnswersAgainOnlyAfterAnAnswer: a teacher that stops in the
// middle of a fill with two chunks in flight (a daemon draining: the
// chunk it computes finishes, the next calls are refused) is said to
// answer again only when a call made after it failed succeeds, not when
// the call it was finishing returns. The fill said "answers again (it
// failed for 0s)" as that call returned, and "failed" again at the next
// refusal. Two workers: call 1 is held until the other worker has failed
// (call 2) and is in its retry (call 3, held until the first worker's
// next call, 4, which it makes once call 1's success is handled); calls
// 3 and 4 fail too, and the rest succeed.
func TestFillSaysAnswersAgainOnlyAfterAnAnswer(t *testing.T) {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	down := status.Error(codes.Unavailable, "connection refused")
	release1, release3 := make(chan struct{}), make(chan struct{})
	a := newFake("a:7070", "/a", nil)
	a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
		switch call {
		case 1:
			<-release1
		case 2:
			return down
		case 3:
			close(release1)
			<-release3
			return down
		case 4:
			close(release3)
			return down
		}
		return nil
	}
	var out syncWriter
	p := FillPlan{Dataset: ds, ChunkSamples: 8, PerWorker: 2, LogEvery: time.Hour, Out: &out}
	if _, err := RunFill(context.Background(), []Worker{a}, p); err != nil {
		t.Fatalf("fill: %v\n%s", err, out.String())
	}
	got := out.String()
	if strings.Count(got, "fill: teacher a:7070 failed (Unavailable: connection refused)") != 1 || strings.Count(got, "fill: teacher a:7070 answers again (it failed for ") != 1 ||
		strings.Index(got, "answers again") < strings.Index(got, "failed (") || strings.Contains(got, "failed for 0s") {
		t.Errorf("want the failure said once, then that it answers again once:\n%s", got)
	}
}

// loadingTeacher is a fake whose Info says the model is still loading
// for its first calls.
type loadingTeacher struct {
	*fakeTeacher
	loading int
}

func (l *loadingTeacher) Info(ctx context.Context) (*pb.InfoResponse, error) {
	if l.loading > 0 {
		l.loading--
		return nil, status.Error(codes.Unavailable, "teacher model still loading: retry when the health check reports SERVING")
	}
	return l.fakeTeacher.Info(ctx)
}

// TestFillWaitsForALoadingTeacher: a fill started while the daemon
// loads its model waits for it, saying so once with what the daemon
// answered, instead of failing (a clock of the test's own).
func TestFillWaitsForALoadingTeacher(t *testing.T) {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	a := &loadingTeacher{fakeTeacher: newFake("a:7070", "/a", nil), loading: 3}
	var out strings.Builder
	p := FillPlan{Dataset: ds, ChunkSamples: 8, PerWorker: 1, LogEvery: time.Hour, Out: &out}
	newFakeClock().use(&p)
	if _, err := RunFill(context.Background(), []Worker{a}, p); err != nil {
		t.Fatalf("fill: %v\n%s", err, out.String())
	}
	if strings.Count(out.String(), "fill: waiting for the teachers to answer (for up to 2m0s, --retry-for): a:7070: Info: teacher model still loading: retry when the health check reports SERVING\n") != 1 {
		t.Errorf("output:\n%s", out.String())
	}
}
