package serve

import (
	"context"
	"fmt"
	"os"
	"os/signal"
	"syscall"

	"go.uber.org/zap"
)

// daemonMain is cmd/teacherd's main loop for the subprocess tests: start,
// publish the address, wait for SIGTERM, drain, exit 0.
func daemonMain(cfg Config, addrFile string) int {
	log, _ := zap.NewDevelopment()
	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
	defer stop()
	d, err := Start(cfg, log)
	if err != nil {
		fmt.Fprintln(os.Stderr, "daemon:", err)
		return 1
	}
	if err := os.WriteFile(addrFile+".tmp", []byte(d.Addr()), 0o644); err != nil || os.Rename(addrFile+".tmp", addrFile) != nil {
		return 1
	}
	<-ctx.Done()
	if err := d.Shutdown(context.Background()); err != nil {
		fmt.Fprintln(os.Stderr, "shutdown:", err)
		return 1
	}
	return 0
}
