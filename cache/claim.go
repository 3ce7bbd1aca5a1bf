package cache

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"time"
)

// Claims: which live writer computes which range now.
//
// Without them two fills of one range (two cachectl processes, two
// teacherd daemons sharing a directory, two requests to one daemon) both
// compute every chunk and one copy is dropped at Commit: nothing is lost,
// but the work is done twice and neither fill knows. BeginChunk therefore
// claims its range first: under the exclusive directory lock it looks at
// the claims of every live writer (tmp/<writer>/claim-A-B files, the
// writer's owner.lock flocked) and either records its own claim or
// returns ErrRangeBusy naming the holder. The claim goes with Commit or
// Abort, and with its writer: a writer that dies releases its owner lock,
// its claims stop counting at once, and GC removes them with its
// directory. So a fill skips what another is computing, does the rest,
// and comes back to the busy ranges later: committed by then (done), or
// free again (the holder aborted or died), and then computed here.
//
// Claims live in the writer's own temporary directory, so they need no
// index transaction and no format change: a writer of an older build
// makes none and is not seen (its copies are dropped at Commit as before).
// The claim is taken before the committed ranges are read, so a range
// that another writer commits under its claim is seen as done.

// claimPrefix starts a claim file's name: claim-AAAAAAAAAAAA-BBBBBBBBBBBB.
const claimPrefix = "claim-"

// Claim is a live writer's claim on a range it is computing.
type Claim struct {
	Range Range `json:"-"`
	// PID and Host name the writer's process; Since is when it claimed.
	PID   int       `json:"pid"`
	Host  string    `json:"host"`
	Since time.Time `json:"since"`
	// Writer is the writer's temporary directory, relative to the cache
	// directory (tmp/<pid>-<hex>).
	Writer string `json:"-"`
}

// String says who holds the claim, for messages.
func (c Claim) String() string {
	return fmt.Sprintf("%v by pid %d on %s since %s (%s)", c.Range, c.PID, c.Host, c.Since.Format(time.DateTime), c.Writer)
}

// BusyError is ErrRangeBusy with the claim that holds the range.
type BusyError struct {
	Want   Range
	Holder Claim
}

func (e *BusyError) Error() string {
	return fmt.Sprintf("%v: %v overlaps %v, which another writer is computing now (pid %d on %s since %s; its files: %s); it will be committed or released",
		ErrRangeBusy, e.Want, e.Holder.Range, e.Holder.PID, e.Holder.Host, e.Holder.Since.Format(time.DateTime), e.Holder.Writer)
}

func (e *BusyError) Unwrap() error { return ErrRangeBusy }

func claimFileName(r Range) string {
	return fmt.Sprintf("%s%012d-%012d", claimPrefix, r.Start, r.End)
}

// parseClaimName returns the range of a claim file's name.
func parseClaimName(n string) (Range, bool) {
	var r Range
	if !strings.HasPrefix(n, claimPrefix) {
		return r, false
	}
	if _, err := fmt.Sscanf(n[len(claimPrefix):], "%d-%d", &r.Start, &r.End); err != nil || r.End <= r.Start {
		return r, false
	}
	return r, true
}

// claim records this writer's claim on r, or returns a *BusyError when a
// live writer (this one included) claims a range overlapping it. The
// returned release removes the claim; it is idempotent.
func (c *Cache) claim(r Range) (release func(), err error) {
	l, err := lockDir(c.dir, true, c.opts.LockTimeout)
	if err != nil {
		return nil, err
	}
	defer l.unlock()
	claims, err := liveClaims(c.dir, c.ws.tmp)
	if err != nil {
		return nil, err
	}
	for _, h := range claims {
		if h.Range.Start < r.End && r.Start < h.Range.End {
			return nil, &BusyError{Want: r, Holder: h}
		}
	}
	host, _ := os.Hostname()
	body, _ := json.Marshal(Claim{PID: os.Getpid(), Host: host, Since: time.Now()})
	p := filepath.Join(c.ws.tmp, claimFileName(r))
	// Not synced: a claim matters only while its writer lives, and a
	// machine that crashes takes every writer on it along.
	if err := os.WriteFile(p, body, 0o644); err != nil {
		return nil, fmt.Errorf("cache: claiming %v: %w", r, err)
	}
	done := false
	return func() {
		if !done {
			done = true
			os.Remove(p)
		}
	}, nil
}

// liveClaims returns the claims of the writers of dir that are alive,
// sorted by range. self, this process's writer directory (or ""), is
// alive without asking its lock.
func liveClaims(dir, self string) ([]Claim, error) {
	ents, err := os.ReadDir(filepath.Join(dir, tmpDir))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("cache: listing writers: %w", err)
	}
	var out []Claim
	for _, e := range ents {
		p := filepath.Join(dir, tmpDir, e.Name())
		if !e.IsDir() || p != self && ownerDead(p) {
			continue
		}
		files, err := os.ReadDir(p)
		if err != nil {
			continue // its writer just closed and removed it
		}
		for _, f := range files {
			r, ok := parseClaimName(f.Name())
			if !ok {
				continue
			}
			cl := Claim{Range: r, Writer: filepath.Join(tmpDir, e.Name())}
			if body, err := os.ReadFile(filepath.Join(p, f.Name())); err == nil {
				json.Unmarshal(body, &cl) // the range and writer stand without it
			}
			out = append(out, cl)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Range.Start < out[j].Range.Start })
	return out, nil
}

// Claims returns the ranges that live writers of the cache in dir are
// computing now, sorted by start (cachectl status shows them). It takes
// no lock: the answer is a snapshot, and reading needs no write
// permission.
func Claims(dir string) ([]Claim, error) { return liveClaims(dir, "") }
