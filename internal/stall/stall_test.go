package stall

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "distill/proto/distill/v1"
)

const T = time.Minute

// TestFiresWhenSilent: nothing heard for the timeout while work is owed
// fires once, with the wait.
func TestFiresWhenSilent(t *testing.T) {
	clk := NewManualClock()
	fired := make(chan time.Duration, 1)
	w := Start(T, clk, nil, func(d time.Duration) { fired <- d })
	clk.Waiting(1)
	clk.Advance(T / 2)
	clk.Advance(T / 2)
	if d := <-fired; d != T {
		t.Errorf("fired after %v, want %v", d, T)
	}
	if waited, stalled := w.Stop(); !stalled || waited != T {
		t.Errorf("Stop = %v, %v; want %v, true", waited, stalled, T)
	}
}

// TestProgressKeepsQuiet: a stream heard from more often than the
// timeout never fires, however long it runs in all.
func TestProgressKeepsQuiet(t *testing.T) {
	clk := NewManualClock()
	w := Start(T, clk, nil, func(time.Duration) { t.Error("fired although the stream was heard every 0.6 timeout") })
	for range 10 { // 6 timeouts in all
		clk.Advance(6 * T / 10)
		w.Alive()
	}
	if _, stalled := w.Stop(); stalled {
		t.Error("stalled")
	}
}

// TestIdleIsNoStall: silence while nothing is owed (an idle Score
// stream) is no stall.
func TestIdleIsNoStall(t *testing.T) {
	clk := NewManualClock()
	asked := make(chan struct{}, 16)
	w := Start(T, clk, func() bool { asked <- struct{}{}; return false }, func(time.Duration) { t.Error("fired while idle") })
	clk.Waiting(1)
	clk.Advance(3 * T)
	<-asked // it looked, found nothing owed
	if _, stalled := w.Stop(); stalled {
		t.Error("stalled")
	}
}

func TestDisabled(t *testing.T) {
	w := Start(0, nil, nil, func(time.Duration) { t.Error("fired") })
	if w != nil {
		t.Fatal("timeout 0 should disable the watchdog")
	}
	w.Alive()
	if _, stalled := w.Stop(); stalled {
		t.Error("stalled")
	}
}

// TestError: a stall is Unavailable (a daemon that failed) and says
// where, how long and which flag.
func TestError(t *testing.T) {
	var err error = &Error{Addr: "h:7070", What: "chunk [0, 8)", Waited: 1500 * time.Millisecond, Flag: "--stall-timeout"}
	if c := status.Code(err); c != codes.Unavailable {
		t.Errorf("code %v, want Unavailable", c)
	}
	var se *Error
	if !errors.As(err, &se) {
		t.Error("errors.As")
	}
	for _, want := range []string{"teacher h:7070 stalled", "chunk [0, 8)", "2s", "raise --stall-timeout", "restart it"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%q lacks %q", err, want)
		}
	}
}

func TestMended(t *testing.T) {
	at := &pb.StatusResponse{ForwardsTotal: 7, UptimeSeconds: 100}
	for _, c := range []struct {
		now  *pb.StatusResponse
		want bool
	}{
		{&pb.StatusResponse{ForwardsTotal: 7, UptimeSeconds: 200}, false}, // hung still
		{&pb.StatusResponse{ForwardsTotal: 8, UptimeSeconds: 200}, true},  // a forward returned
		{&pb.StatusResponse{ForwardsTotal: 7, UptimeSeconds: 3}, true},    // restarted
	} {
		if got := Mended(at, c.now); got != c.want {
			t.Errorf("Mended(%v, %v) = %v", at, c.now, got)
		}
	}
}

// TestRecheck: nil once the daemon mended since it stalled; else ask's
// error, or an Unavailable one naming the option and its timeout.
func TestRecheck(t *testing.T) {
	at := &pb.StatusResponse{ForwardsTotal: 7, UptimeSeconds: 100}
	ask := func(st *pb.StatusResponse, err error) func(context.Context) (*pb.StatusResponse, error) {
		return func(context.Context) (*pb.StatusResponse, error) { return st, err }
	}
	if err := Recheck(context.Background(), ask(&pb.StatusResponse{ForwardsTotal: 8, UptimeSeconds: 130}, nil), at, "--stall-timeout", time.Minute); err != nil {
		t.Fatalf("a forward since: %v", err)
	}
	gone := errors.New("connection refused")
	if err := Recheck(context.Background(), ask(nil, gone), at, "--stall-timeout", time.Minute); err != gone {
		t.Fatalf("Status failing: %v", err)
	}
	err := Recheck(context.Background(), ask(&pb.StatusResponse{ForwardsTotal: 7, UptimeSeconds: 130}, nil), at, "distill.stall_timeout", 10*time.Minute)
	if status.Code(err) != codes.Unavailable || !strings.Contains(err.Error(), "distill.stall_timeout 10m0s") || !strings.Contains(err.Error(), "(7 in all)") {
		t.Fatalf("still stalled: %v", err)
	}
}
