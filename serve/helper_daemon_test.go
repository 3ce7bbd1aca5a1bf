package serve

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"

	"distill/infer"
)

// daemonMain is cmd/teacherd's main loop for the subprocess tests: start,
// print "addr ADDR" on stdout, wait for SIGTERM, print "stopping", drain,
// exit 0. With hold > 0 its hold-th forward pass prints "held N" and waits
// for a line on stdin before it computes: the parent acts (kill, signal)
// while the daemon is known to be inside a chunk, then releases it or not.
// Stdin at EOF (the parent is gone) ends the process.
func daemonMain(cfg Config, hold int) int {
	log, _ := zap.NewDevelopment()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	d, err := Start(cfg, log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "daemon:", err)
		return 1
	}
	if hold > 0 {
		// Wrapped before the address is published: no forward has run.
		// A pipelined teacher's forwards are started (b.start), on the
		// batcher's loop too: the hold keeps the forwards in flight going.
		b := d.Core().b
		b.mu.Lock()
		n := 0
		wait := func() {
			if n++; n == hold { // one batcher goroutine calls fwd, or start
				fmt.Printf("held %d\n", n)
				if _, err := bufio.NewReader(os.Stdin).ReadString('\n'); err != nil {
					fmt.Fprintln(os.Stderr, "daemon: stdin closed while held:", err)
					os.Exit(3)
				}
			}
		}
		if real := b.start; real != nil {
			b.start = func(s [][]int32, k int, temp float32, dr *infer.Draws) func() ([]int32, []float32, infer.DrawResult) {
				wait()
				return real(s, k, temp, dr)
			}
		} else {
			real := b.fwd
			b.fwd = func(s [][]int32, k int, temp float32) ([]int32, []float32) {
				wait()
				return real(s, k, temp)
			}
		}
		b.mu.Unlock()
	}
	fmt.Printf("addr %s\n", d.Addr())
	<-ctx.Done()
	fmt.Println("stopping")
	if err := d.Shutdown(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "shutdown:", err)
		return 1
	}
	return 0
}
