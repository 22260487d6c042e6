// Command go-client is the README's Go client example: it takes the lock
// "invoices" with a watchdog-renewed lease and writes to Redfence's reference
// store with the lease's fencing token.
//
//	REDFENCE_SERVER=http://127.0.0.1:8080 REDFENCE_API_KEY=$KEY go run ./examples/go-client
package main

import (
	"context"
	"errors"
	"fmt"
	"log"
	"os"
	"time"

	"github.com/redfence/redfence/client"
)

func main() {
	server := os.Getenv("REDFENCE_SERVER")
	if server == "" {
		server = "http://127.0.0.1:8080"
	}
	if err := run(context.Background(), server, os.Getenv("REDFENCE_API_KEY")); err != nil {
		log.Fatal(err)
	}
}

func run(ctx context.Context, server, apiKey string) error {
	c, err := client.New(server, client.Options{APIKey: apiKey, Owner: "go-client-example"})
	if err != nil {
		return err
	}
	// Do acquires (waiting up to 5 s), renews the lease every TTL/3 while fn
	// runs, cancels fn's ctx the moment the lease is lost, and always releases.
	err = c.Do(ctx, "invoices", &client.LockOptions{TTL: 10 * time.Second, Wait: 5 * time.Second},
		func(ctx context.Context, l *client.Lease) error {
			fmt.Printf("holding %q with fencing token %d until %s\n", l.Name(), l.FencingToken(), l.Deadline().Format(time.RFC3339Nano))
			res, err := c.PutResource(ctx, "invoices", l.FencingToken(), map[string]int{"total": 42})
			if err != nil {
				return err
			}
			fmt.Printf("wrote version %d with token %d\n", res.Version, res.FencingToken)
			return nil
		})
	switch {
	case errors.Is(err, client.ErrHeld):
		return fmt.Errorf("someone else holds the lock: %w", err)
	case errors.Is(err, client.ErrLost), errors.Is(err, client.ErrStale):
		return fmt.Errorf("the lease was lost while working; the fencing token protected the data: %w", err)
	}
	return err
}
