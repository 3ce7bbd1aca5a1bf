package serve

import (
	"context"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"

	"distill/cache"
	pb "distill/proto/distill/v1"
)

// TestDrainEndsScoreStreams: a drain (SIGTERM) ends an open Score stream
// once it has answered what it holds, with Unavailable saying why, so
// the daemon stops without waiting out --drain-timeout. An online
// student keeps its stream open for the whole run: the daemon waited the
// 30s default, then cancelled it and logged "drain timeout: cancelling
// in-flight requests (their chunks are aborted)", and the student saw
// gRPC's "closing transport due to: ... graceful_stop".
func TestDrainEndsScoreStreams(t *testing.T) {
	core, logs := observer.New(zapcore.InfoLevel)
	// The timeout bounds only the failing case: a fixed daemon does not
	// wait for it.
	d, err := Start(Config{Model: tinyModel(t), Listen: "127.0.0.1:0", Metrics: "off", DrainTimeout: 5 * time.Second}, zap.New(core))
	if err != nil {
		t.Fatal(err)
	}
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()
	st, err := cl.Score(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if err := st.Send(&pb.ScoreRequest{Id: 1, Tokens: []int32{1, 2, 3}, K: proto.Int32(2)}); err != nil {
		t.Fatal(err)
	}
	if r, err := st.Recv(); err != nil || r.GetId() != 1 {
		t.Fatalf("answer before the drain: %v, %v", r, err)
	}

	done := make(chan error, 1)
	go func() { done <- d.Shutdown(context.Background()) }()
	_, err = st.Recv()
	wantCode(t, "stream at drain", err, codes.Unavailable, "teacherd is shutting down (SIGTERM or Ctrl-C)")
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if n := logs.FilterMessageSnippet("drain timeout").Len(); n != 0 {
		t.Errorf("the drain waited out its timeout for the open stream")
	}
	if logs.FilterMessage("drained: all in-flight requests finished").Len() != 1 {
		t.Errorf("no \"drained\" log line")
	}
}

// TestForeignCacheWarnedAtStart: a --cache that holds another teacher's
// committed chunks is said at start, once the teacher is loaded (every
// Fill will be refused; it showed only at the first Fill); the daemon's
// own teacher's cache, and one with no committed chunk (it takes the
// next Fill's manifest), are not.
func TestForeignCacheWarnedAtStart(t *testing.T) {
	own := func(d *Daemon) string { return d.Core().Info().GetTeacherFingerprint() }
	probe, err := Start(Config{Model: tinyModel(t), Listen: "127.0.0.1:0", Metrics: "off"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	fp := own(probe)
	probe.Shutdown(context.Background())
	for _, c := range []struct {
		teacher string
		commit  bool
		warn    bool
	}{{"another-teacher", true, true}, {fp, true, false}, {"another-teacher", false, false}} {
		dir := t.TempDir()
		cw, err := cache.Create(dir, cache.Manifest{TeacherFingerprint: c.teacher, TokenizerFingerprint: "tok", DatasetFingerprint: "data",
			VocabSize: 512, K: 2, Temperature: 1, Samples: 4, Encoding: cache.EncodingCompact}, nil)
		if err != nil {
			t.Fatal(err)
		}
		if c.commit {
			w, err := cw.BeginChunk(0, 1)
			if err != nil {
				t.Fatal(err)
			}
			if err := w.Add(cache.Sample{Index: 0, Tokens: []int32{1, 2}, Mask: []uint8{1, 1}, TopKIDs: []int32{3, 4, 5, 6}, TopKLogProbs: []float32{-0.5, -1.5, -0.7, -1.2}}); err != nil {
				t.Fatal(err)
			}
			if err := w.Commit(); err != nil {
				t.Fatal(err)
			}
		}
		cw.Close()
		core, logs := observer.New(zapcore.WarnLevel)
		d, err := Start(Config{Model: tinyModel(t), Cache: dir, Listen: "127.0.0.1:0", Metrics: "off"}, zap.New(core))
		if err != nil {
			t.Fatal(err)
		}
		d.Shutdown(context.Background())
		if got := logs.FilterMessageSnippet("the cache directory holds another teacher's fill").Len(); got != map[bool]int{true: 1, false: 0}[c.warn] {
			t.Errorf("cache of teacher %q (committed %v): %d warnings, want warn=%v", c.teacher, c.commit, got, c.warn)
		}
	}
}
