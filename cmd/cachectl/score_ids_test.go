package main

import (
	"context"
	"strings"
	"testing"

	"distill/internal/cli"
	"distill/serve"
)

// TestScoreBadIDs: an empty sample in --ids (a trailing or doubled ";")
// is a usage error found before any teacher is asked (through a daemon
// it printed the samples before it, then "rpc error: code =
// InvalidArgument desc = sample id 1 is empty", exit 1; in-process
// "sample 1 is empty", exit 1), and a daemon's refusal of an id reads
// as its message, not as a gRPC status.
func TestScoreBadIDs(t *testing.T) {
	mdir := fillModel(t, 64)
	d, err := serve.Start(serve.Config{Model: mdir, Listen: "127.0.0.1:0", Metrics: "off", Device: "cpu"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Shutdown(context.Background())
	for _, ids := range []string{"1,2;", "1;;2", ";1"} {
		for _, mode := range [][]string{{"--teacher", d.Addr()}, {"--model", mdir, "--device", "cpu"}} {
			err := runScore(append([]string{"--ids", ids}, mode...))
			if err == nil || cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), "--ids: sample ") || !strings.Contains(err.Error(), "is empty") {
				t.Errorf("score %v --ids %q: %v (exit %d), want a usage error naming the empty sample", mode[0], ids, err, cli.ExitStatus(err))
			}
		}
	}
	// An id left out between two commas is an error too (it was dropped
	// and the sample scored without it); a trailing comma is not.
	if err := runScore([]string{"--ids", "1,,2", "--model", mdir, "--device", "cpu"}); cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), `--ids: sample 0: an empty id between two commas ("1,,2")`) {
		t.Errorf("score --ids 1,,2: %v (exit %d), want a usage error", err, cli.ExitStatus(err))
	}
	if err := runScore([]string{"--ids", "1,2,", "--model", mdir, "--device", "cpu"}); err != nil {
		t.Errorf("score --ids 1,2, (a trailing comma): %v", err)
	}
	err = runScore([]string{"--ids", "1,2,64", "--teacher", d.Addr()})
	if err == nil || !strings.Contains(err.Error(), "teacher "+d.Addr()+": sample 0: sample id 0 position 2: token id 64 out of range [0, 64)") || strings.Contains(err.Error(), "rpc error") {
		t.Errorf("score --teacher of an id past the vocab: %v", err)
	}
}
