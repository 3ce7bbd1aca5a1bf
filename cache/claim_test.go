package cache

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestClaims: BeginChunk claims its range until Commit or Abort; another
// writer of the directory (or this one) gets ErrRangeBusy for any
// overlapping range, naming the holder, and the range once the claim is
// gone: done after a commit, free after an abort, a Close or the
// holder's death.
func TestClaims(t *testing.T) {
	dir := t.TempDir()
	c1, err := Create(dir, testManifest(20, EncodingCompact), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c1.Close()
	c2, err := Open(dir, nil) // a second writer: its own tmp/ directory, as another process has
	if err != nil {
		t.Fatal(err)
	}
	defer c2.Close()
	busy := func(c *Cache, a, b int64, holder Range) {
		t.Helper()
		_, err := c.BeginChunk(a, b)
		var be *BusyError
		if !errors.Is(err, ErrRangeBusy) || !errors.As(err, &be) || be.Holder.Range != holder || be.Holder.PID != os.Getpid() ||
			!strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) || !strings.Contains(err.Error(), holder.String()) {
			t.Fatalf("BeginChunk(%d, %d) beside a claim on %v: %v", a, b, holder, err)
		}
	}
	claims := func(want string) {
		t.Helper()
		cl, err := Claims(dir)
		if err != nil {
			t.Fatal(err)
		}
		var got []string
		for _, c := range cl {
			got = append(got, c.Range.String())
		}
		if fmt.Sprint(got) != want {
			t.Fatalf("claims %v, want %s", got, want)
		}
	}

	w1, err := c1.BeginChunk(0, 4)
	if err != nil {
		t.Fatal(err)
	}
	claims(fmt.Sprint([]string{Range{0, 4}.String()}))
	busy(c2, 0, 4, Range{0, 4})
	busy(c2, 2, 6, Range{0, 4}) // overlapping, not equal
	busy(c1, 0, 4, Range{0, 4}) // the same writer: two requests to one daemon
	w2, err := c2.BeginChunk(4, 8)
	if err != nil {
		t.Fatalf("a disjoint range: %v", err)
	}
	w2.Abort()
	w1.Abort()
	claims("[]")

	// Released by Abort: the other writer takes the range and commits it;
	// then it is done for everyone, and no claim is left.
	fillRange(t, c2, 0, 4)
	claims("[]")
	if _, err := c1.BeginChunk(0, 4); !errors.Is(err, ErrRangeDone) {
		t.Fatalf("a range committed under another's claim: %v", err)
	}

	// A writer that closes drops its claims with its directory.
	c3, err := Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c3.BeginChunk(8, 12); err != nil {
		t.Fatal(err)
	}
	busy(c1, 8, 12, Range{8, 12})
	c3.Close()
	fillRange(t, c1, 8, 12)

	// A writer that died (its owner.lock not held) claims nothing, though
	// its claim file is still there until GC.
	dead := filepath.Join(dir, tmpDir, "99999-deadbeef0000")
	if err := os.MkdirAll(dead, 0o755); err != nil {
		t.Fatal(err)
	}
	os.WriteFile(filepath.Join(dead, ownerLock), nil, 0o644)
	os.WriteFile(filepath.Join(dead, claimFileName(Range{12, 16})), []byte(`{"pid":99999,"host":"gone"}`), 0o644)
	claims("[]")
	fillRange(t, c1, 12, 16)
	rep := mustCheck(t, dir)
	if rep.Chunks != 3 {
		t.Fatalf("%d chunks, want 3", rep.Chunks)
	}
}

func TestParseClaimName(t *testing.T) {
	r := Range{12, 345}
	if got, ok := parseClaimName(claimFileName(r)); !ok || got != r {
		t.Fatalf("%q: %v %v", claimFileName(r), got, ok)
	}
	for _, n := range []string{"owner.lock", "claim-", "claim-5-5", "claim-x-9", "000000000000-000000000004.arrow.1.tmp"} {
		if _, ok := parseClaimName(n); ok {
			t.Errorf("%q parsed as a claim", n)
		}
	}
}
