package dist

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"distill/internal/cli"
)

// rankModeVar makes this test binary act as one rank of a launched job
// (TestMain), in the mode it names.
const rankModeVar = "DIST_TEST_RANK_MODE"

func TestMain(m *testing.M) {
	if mode := os.Getenv(rankModeVar); mode != "" {
		os.Exit(rankMain(mode))
	}
	os.Exit(m.Run())
}

// rankMain is a rank of the launcher tests:
//   - ok: joins, broadcasts rank 0's greeting, passes a barrier, exits 0;
//   - fail: rank 1 exits 3 after the rendezvous, the others wait in a
//     barrier, which fails;
//   - hang: rank 1 exits 3 after the rendezvous, the others ignore SIGTERM
//     and hang until killed;
//   - signal: every rank says "ready", then waits for SIGTERM or SIGINT
//     and exits 128+signal.
func rankMain(mode string) int {
	var sigs chan os.Signal
	switch mode {
	case "hang":
		signal.Ignore(syscall.SIGTERM)
	case "signal":
		sigs = make(chan os.Signal, 1)
		signal.Notify(sigs, syscall.SIGTERM, syscall.SIGINT)
	}
	env, err := Discover()
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 2
	}
	ctx := context.Background()
	g, err := Join(ctx, env, Options{Config: map[string]string{"mode": mode}, UniqueID: randomID, JoinTimeout: bound, Log: os.Stderr})
	if err != nil {
		fmt.Fprintln(os.Stderr, "join:", err)
		return 1
	}
	id := sha256.Sum256(g.UniqueID())
	fmt.Printf("rank %d of %d joined, local rank %d, id %x\n", g.Rank(), g.WorldSize(), env.LocalRank, id[:6])
	switch mode {
	case "ok":
		b, err := g.Broadcast(ctx, 0, []byte("hello from rank 0"))
		if err == nil {
			err = g.Barrier(ctx)
		}
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		fmt.Printf("rank %d got %q\n", g.Rank(), b)
		fmt.Fprintf(os.Stderr, "rank %d done\n", g.Rank())
		g.Close()
		return 0
	case "fail", "hang":
		if g.Rank() == 1 {
			fmt.Fprintln(os.Stderr, "rank 1 gives up")
			return 3
		}
		if mode == "hang" {
			select {}
		}
		err := g.Barrier(ctx)
		fmt.Fprintf(os.Stderr, "rank %d's barrier: %v\n", g.Rank(), err)
		return 1
	case "stopped":
		// every rank exits as one a signal stopped (train.sigterm_exit_status 143)
		if err := g.Barrier(ctx); err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		g.Close()
		return 128 + int(syscall.SIGTERM)
	case "signal":
		fmt.Println("ready")
		sig := <-sigs
		fmt.Printf("rank %d got %s\n", g.Rank(), cli.SignalName(sig))
		g.Close()
		return 128 + int(sig.(syscall.Signal))
	}
	return 2
}

// launch runs n ranks of this test binary in mode.
func launch(t *testing.T, n int, mode string, stdout *syncBuffer, sigs chan os.Signal) (err error, out, errOut, log string) {
	t.Helper()
	var stderr, logs syncBuffer
	done := make(chan error, 1)
	go func() {
		done <- Launch(LaunchOptions{NProc: n, Path: os.Args[0], Env: append(os.Environ(), rankModeVar+"="+mode),
			Stdout: stdout, Stderr: &stderr, Log: &logs, Grace: 200 * time.Millisecond, Signals: sigs})
	}()
	select {
	case err = <-done:
	case <-time.After(bound):
		t.Fatalf("Launch did not return within %s; output:\n%s\n%s\n%s", bound, stdout.String(), stderr.String(), logs.String())
	}
	return err, stdout.String(), stderr.String(), logs.String()
}

// TestLaunch: three ranks rendezvous, agree on the unique id, broadcast
// and pass a barrier; their output comes back prefixed with their rank.
func TestLaunch(t *testing.T) {
	err, out, errOut, log := launch(t, 3, "ok", newSyncBuffer(""), make(chan os.Signal))
	if err != nil {
		t.Fatalf("%v\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errOut, log)
	}
	ids := map[string]bool{}
	for r := range 3 {
		m := regexp.MustCompile(fmt.Sprintf(`(?m)^\[rank %d\] rank %d of 3 joined, local rank %d, id ([0-9a-f]+)$`, r, r, r)).FindStringSubmatch(out)
		if m == nil {
			t.Fatalf("no join line of rank %d in:\n%s", r, out)
		}
		ids[m[1]] = true
		for _, want := range []string{fmt.Sprintf("[rank %d] rank %d got \"hello from rank 0\"\n", r, r)} {
			if !strings.Contains(out, want) {
				t.Errorf("stdout lacks %q:\n%s", want, out)
			}
		}
		if want := fmt.Sprintf("[rank %d] rank %d done\n", r, r); !strings.Contains(errOut, want) {
			t.Errorf("stderr lacks %q:\n%s", want, errOut)
		}
	}
	if len(ids) != 1 {
		t.Errorf("the ranks got %d unique ids: %v", len(ids), ids)
	}
	if !strings.Contains(log, "started 3 ranks") {
		t.Errorf("log: %s", log)
	}
}

// TestLaunchRankFails: a rank exiting non-zero takes the job down: the
// others learn it through the control plane, and Launch names it.
func TestLaunchRankFails(t *testing.T) {
	err, out, errOut, log := launch(t, 3, "fail", newSyncBuffer(""), make(chan os.Signal))
	var re *RankError
	if !errors.As(err, &re) || re.Rank != 1 || !strings.Contains(err.Error(), "rank 1 exited with status 3") {
		t.Fatalf("%v, want a RankError naming rank 1\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errOut, log)
	}
	for _, r := range []int{0, 2} {
		if !strings.Contains(err.Error(), fmt.Sprintf("rank %d exited with status 1", r)) {
			t.Errorf("%q lacks rank %d's status", err, r)
		}
		if !regexp.MustCompile(fmt.Sprintf(`\[rank %d\] rank %d's barrier: rank 1 \(.*\) died`, r, r)).MatchString(errOut) {
			t.Errorf("rank %d did not say rank 1 died:\n%s", r, errOut)
		}
	}
	if !strings.Contains(errOut, "[rank 1] rank 1 gives up\n") || !strings.Contains(log, "stopping the other ranks") {
		t.Errorf("stderr:\n%s\nlog:\n%s", errOut, log)
	}
}

// TestLaunchKillsHungRanks: ranks that neither end nor heed SIGTERM after
// another failed are killed.
func TestLaunchKillsHungRanks(t *testing.T) {
	err, out, errOut, log := launch(t, 3, "hang", newSyncBuffer(""), make(chan os.Signal))
	var re *RankError
	if !errors.As(err, &re) || re.Rank != 1 || !strings.Contains(err.Error(), "rank 1 exited with status 3; then rank") {
		t.Fatalf("%v\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errOut, log)
	}
	for _, r := range []int{0, 2} {
		if !strings.Contains(err.Error(), fmt.Sprintf("rank %d was killed by SIGKILL", r)) {
			t.Errorf("%q: rank %d was not killed", err, r)
		}
	}
	if !strings.Contains(log, "SIGTERM") || !strings.Contains(log, "SIGKILL") {
		t.Errorf("log:\n%s", log)
	}
}

// TestLaunchForwardsSignals: SIGTERM reaches every rank once; the job
// ends as interrupted by it.
func TestLaunchForwardsSignals(t *testing.T) {
	stdout := newSyncBufferN("ready\n", 3)
	sigs := make(chan os.Signal, 1)
	go func() {
		<-stdout.seen
		sigs <- syscall.SIGTERM
	}()
	err, out, errOut, log := launch(t, 3, "signal", stdout, sigs)
	var in *cli.Interrupted
	if !errors.As(err, &in) || in.Signal != syscall.SIGTERM {
		t.Fatalf("%v, want cli.Interrupted by SIGTERM\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errOut, log)
	}
	for r := range 3 {
		if want := fmt.Sprintf("[rank %d] rank %d got SIGTERM\n", r, r); strings.Count(out, want) != 1 {
			t.Errorf("stdout has %q %d times:\n%s", want, strings.Count(out, want), out)
		}
		if !strings.Contains(err.Error(), fmt.Sprintf("rank %d exited with status 143", r)) {
			t.Errorf("%q lacks rank %d", err, r)
		}
	}
}

// TestLaunchRanksStopped: ranks that all exit 143 (128+SIGTERM: stopped
// after saving their progress, as every rank of a job whose one rank got
// SIGTERM does under train.sigterm_exit_status 143) end the job as
// interrupted by SIGTERM, with no signal of Launch's own and no rank
// stopped as after a failure.
func TestLaunchRanksStopped(t *testing.T) {
	err, out, errOut, log := launch(t, 3, "stopped", &syncBuffer{}, make(chan os.Signal))
	var in *cli.Interrupted
	if !errors.As(err, &in) || in.Signal != syscall.SIGTERM || cli.ExitStatus(err) != 143 {
		t.Fatalf("%v, want cli.Interrupted by SIGTERM\nstdout:\n%s\nstderr:\n%s\nlog:\n%s", err, out, errOut, log)
	}
	if strings.Contains(log, "stopping the other ranks") {
		t.Fatalf("a stopped rank was taken for a failed one:\n%s", log)
	}
}

func TestLineWriter(t *testing.T) {
	var buf syncBuffer
	w := &lineWriter{w: &buf, mu: new(sync.Mutex), prefix: "[rank 3] "}
	w.Write([]byte("a"))
	w.Write([]byte("b\nc\nd"))
	if got := buf.String(); got != "[rank 3] ab\n[rank 3] c\n" {
		t.Fatalf("%q", got)
	}
	w.flush()
	if got := buf.String(); got != "[rank 3] ab\n[rank 3] c\n[rank 3] d\n" {
		t.Fatalf("%q", got)
	}
}
