package serve

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// TestProgressBarDoubleCountedChunk: a chunk counted twice (a teacher
// reported it and failed, another redid it) makes the computed samples
// exceed the range; the bar used to ask strings.Repeat for a negative
// count and panic. It is clamped to a full bar.
func TestProgressBarDoubleCountedChunk(t *testing.T) {
	var samples, tokens atomic.Int64
	samples.Store(12) // a 10-sample range, one 2-sample chunk counted twice
	tokens.Store(300)
	var out strings.Builder
	p := &FillPlan{Out: &out, Terminal: true}
	stop := startProgress(p, 10, 0, &samples, &tokens, time.Now(), nil)
	stop() // draws the last line at once, whatever the ticker did
	last := out.String()[strings.LastIndex(out.String(), "\r"):]
	if !strings.Contains(last, "["+strings.Repeat("=", 30)+"] 10/10 samples 100.0%") {
		t.Errorf("last line %q, want a full bar at 10/10", last)
	}
	for _, c := range []struct {
		total, already, s int64
		want              string
	}{
		{10, 8, 4, "fill: 10/10 samples (100.0%)"}, // already done + recomputed
		{10, 0, -3, "fill: 0/10 samples (0.0%)"},   // never negative
		{10, 5, 0, "fill: 5/10 samples (50.0%)"},   // normal
	} {
		if got := progressLine(false, c.total, c.already, c.s, 0, 1); !strings.HasPrefix(got, c.want) {
			t.Errorf("progressLine(%d, %d, %d) = %q, want %q", c.total, c.already, c.s, got, c.want)
		}
		if got := progressLine(true, c.total, c.already, c.s, 0, 1); strings.Count(got, "=")+strings.Count(got[:strings.Index(got, "]")], " ") != 30 {
			t.Errorf("terminal bar for (%d, %d, %d) is not 30 wide: %q", c.total, c.already, c.s, got)
		}
	}
}

// TestProgressRateLeavesOutWaits: the fill works 10s, waits 60s for its
// only teacher, which answers again and works 10s more. The rate and the
// ETA count the 20s of work, not the 80s since the start: they used to
// read 4x low and 4x long after any such wait, until the end of the run.
func TestProgressRateLeavesOutWaits(t *testing.T) {
	t0 := time.Date(2024, 1, 1, 12, 0, 0, 0, time.UTC)
	now := t0
	p := &FillPlan{Terminal: true, now: func() time.Time { return now }}
	var out strings.Builder
	p.Out = &out
	d := newFillDispatch(p, nil, "", &FillSummary{}, nil)
	d.up = 1
	w := &fakeTeacher{name: "a:7070"}

	now = t0.Add(10 * time.Second)
	d.setUp(w, -1) // the teacher fails
	now = now.Add(60 * time.Second)
	d.setUp(w, +1) // and answers again
	now = now.Add(10 * time.Second)
	d.samples.Store(20)
	d.tokens.Store(2000)

	stop := startProgress(p, 100, 0, &d.samples, &d.tokens, t0, d.waiting)
	stop() // draws the last line at once, whatever the ticker did
	last := out.String()[strings.LastIndex(out.String(), "\r"):]
	// 2000 tokens in 20s of work; 80 samples left at 20 per 20s.
	if !strings.Contains(last, " 100 tokens/s  ETA 1m20s ") {
		t.Errorf("progress after a 60s wait: %q, want 100 tokens/s and ETA 1m20s (the 60s wait left out)", last)
	}
}

// TestFillSummaryRateLeavesOutWaits: the summary's tokens/s is over the
// time a teacher answered, as the progress line's: a fill of 6000
// tokens in 90s, 30s of which no teacher answered, ran at 100 tokens/s,
// not 67, and says how long it waited.
func TestFillSummaryRateLeavesOutWaits(t *testing.T) {
	var out strings.Builder
	(&FillSummary{Tokens: 6000, Elapsed: 90 * time.Second, Waited: 30 * time.Second}).print(&out)
	if !strings.Contains(out.String(), "(100 tokens/s over the 1m0s a teacher answered; 30s waiting for one)") {
		t.Errorf("summary with a 30s wait: %q", out.String())
	}
	out.Reset()
	(&FillSummary{Tokens: 6000, Elapsed: 60 * time.Second}).print(&out)
	if !strings.Contains(out.String(), "in 1m0s (100 tokens/s);") {
		t.Errorf("summary without a wait: %q", out.String())
	}
}
