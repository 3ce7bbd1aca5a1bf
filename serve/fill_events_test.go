package serve

import (
	"context"
	"strings"
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
